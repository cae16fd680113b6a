"""The greedy serving head's bf16 screen (`llama.serving_argmax`), as XLA's bf16 dot and as the
CPU kernel's packed copy: certified rows are the f32 argmax, near-ties fall back to the f32 head,
and decoding stays token-identical with it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import cpu_kernels, generate, load_drafter
from hsd_jax.cache import init_cache
from hsd_jax.models import llama
from tests.helpers import tiny_target

screened = jax.jit(llama.screened_argmax, static_argnums=(1, 4, 5))
serving_argmax = jax.jit(llama.serving_argmax, static_argnums=1)


def f32_argmax(params, cfg, features):
    return np.asarray(jnp.argmax(llama.logits_from_features(params, cfg, features), -1))


def screen_params(params, form):
    """params whose `head_screen` is XLA's [V, d] bf16 dot ("xla") or the kernel's packed copy."""
    if form == "xla":
        return params
    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels could not be built here")
    e = params["embed_tokens"]["embedding"]
    return dict(params, packed_kernels={"head_screen": jnp.asarray(cpu_kernels.pack_head_screen(e)),
                                        "head_screen_norms": jnp.asarray(cpu_kernels.head_screen_norms(e))})


FORMS = pytest.mark.parametrize("form", ["xla", "kernel"])


def test_the_packed_screen_norms_are_the_per_call_ones(smol):
    """`serving_params` packs the screen's error norms once (`cpu_kernels.head_screen_norms`); `head_screen`
    serves those, equal to what it computes per call without them, in any number of rows."""
    from hsd_jax.api import serving_params

    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels could not be built here")
    params, cfg = serving_params(smol, ready=True), smol.config
    packed = params["packed_kernels"]
    per_call = llama.head_screen(dict(params, packed_kernels={"head_screen": packed["head_screen"]}), cfg, 1)
    for rows in (1, 8):
        screen = llama.head_screen(params, cfg, rows)
        traced = str(jax.make_jaxpr(lambda p: llama.head_screen(p, cfg, rows))(params))
        assert "reduce_sum" not in traced and "convert_element_type" not in traced   # no pass over the embedding
        np.testing.assert_allclose(np.asarray(screen.norm), np.asarray(per_call.norm), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(screen.err_norm), np.asarray(per_call.err_norm), rtol=1e-5, atol=1e-12)


@FORMS
def test_screen_certifies_real_features_and_agrees_with_f32(smol, mt_prompts, form):
    """Every answer position of a real greedy answer: certified rows are the f32 argmax, and nearly
    all rows certify (measured: all of them on MT-bench), else the screen would cost time."""
    cfg = smol.config
    ids = smol.encode(mt_prompts[3], chat=True)
    answer = generate(smol, [ids], max_new_tokens=64)[0].token_ids
    seq = jnp.asarray([ids + answer], jnp.int32)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, seq.shape[1] + 16, cfg.head_dim)
    _, out = llama.forward_logits(smol.params, cfg, seq, jnp.arange(seq.shape[1])[None], cache)
    feats = out.features[0, len(ids) - 1:]
    params = screen_params(smol.params, form)
    screen = llama.head_screen(params, cfg, 16)
    assert screen.weight.ndim == (2 if form == "xla" else 4)
    certified = []
    for i in range(0, feats.shape[0] - 15, 16):
        tok, ok = screened(params, cfg, feats[i:i + 16], screen, llama.SCREEN_CANDIDATES)
        ok = np.asarray(ok)
        ref = f32_argmax(smol.params, cfg, feats[i:i + 16])
        assert (np.asarray(tok)[ok] == ref[ok]).all()
        np.testing.assert_array_equal(np.asarray(serving_argmax(params, cfg, feats[i:i + 16], screen)), ref)
        certified.append(ok)
    assert np.concatenate(certified).mean() >= 0.9


@FORMS
@pytest.mark.parametrize("rows", [1, 4])
def test_near_ties_fall_back_to_the_f32_head(form, rows):
    """Tokens 0..19 share one embedding up to 1e-4: the bf16 screen cannot order them, so no row
    certifies from 16 candidates and `serving_argmax` answers from the f32 head; with exact
    duplicates inside the candidates the lowest id wins, as `jnp.argmax`. (Vocabulary 70: the
    kernel's copy pads it to whole 32-column tiles.)"""
    target = tiny_target(vocab=70, hidden=32, tie_word_embeddings=True)
    cfg = target.config
    e = np.asarray(target.params["embed_tokens"]["embedding"]).copy()
    u = np.random.default_rng(0).standard_normal(32).astype(np.float32)
    e[:20] = 3 * u + 1e-4 * np.random.default_rng(1).standard_normal((20, 32)).astype(np.float32)
    e[40] = e[41] = 2.5 * u
    params = screen_params(dict(target.params, embed_tokens={"embedding": jnp.asarray(e)}), form)
    feats = jnp.asarray(u[None] + 0.01 * np.random.default_rng(2).standard_normal((rows, 32)), jnp.float32)
    screen = llama.head_screen(params, cfg, rows)
    if form == "xla" and rows == 1:         # XLA's one-row f32 GEMV beats its bf16 dot: no screen
        assert screen is None
        return
    _, ok = screened(params, cfg, feats, screen, 16)
    assert not np.asarray(ok).any()
    np.testing.assert_array_equal(np.asarray(serving_argmax(params, cfg, feats, screen)), f32_argmax(params, cfg, feats))

    e[:20] = np.random.default_rng(3).standard_normal((20, 32)).astype(np.float32) * 0.1
    params = screen_params(dict(target.params, embed_tokens={"embedding": jnp.asarray(e)}), form)
    screen = llama.head_screen(params, cfg, rows)
    tok, ok = screened(params, cfg, feats, screen, 16)
    assert np.asarray(ok).all() and (np.asarray(tok) == 40).all()


@FORMS
def test_near_ties_outside_the_candidates_blocks_are_bounded_too(form):
    """A vocabulary the screen's blocks divide (8192 = 128 blocks of 64): the tokens outside the
    candidates' blocks are bounded from each block's maxima (`llama._others_bound`). 24 near-equal
    tokens spread one to a block: 16 become candidates, the other 8 sit in blocks with none, and
    the screen must not certify; an embedding with one clear winner certifies, the f32 argmax."""
    target = tiny_target(vocab=8192, hidden=32, tie_word_embeddings=True)
    cfg = target.config
    e = 0.05 * np.random.default_rng(0).standard_normal((8192, 32)).astype(np.float32)
    u = np.random.default_rng(1).standard_normal(32).astype(np.float32)
    spread = np.arange(24) * 320 + 7                                    # 24 different blocks
    e[spread] = 3 * u + 1e-4 * np.random.default_rng(2).standard_normal((24, 32)).astype(np.float32)
    feats = jnp.asarray(u[None] + 0.01 * np.random.default_rng(3).standard_normal((4, 32)), jnp.float32)
    for winner in (None, 5000):
        if winner is not None:
            e[winner] = 4 * u
        params = screen_params(dict(target.params, embed_tokens={"embedding": jnp.asarray(e)}), form)
        screen = llama.head_screen(params, cfg, 4)
        tok, ok = screened(params, cfg, feats, screen, 16)
        want = f32_argmax(params, cfg, feats)
        if winner is None:
            assert not np.asarray(ok).any()
            assert set(want) <= set(spread)
        else:
            assert np.asarray(ok).all() and (np.asarray(tok) == winner).all() and (want == winner).all()
        np.testing.assert_array_equal(np.asarray(serving_argmax(params, cfg, feats, screen)), want)


@FORMS
def test_rows_the_blocks_miss_certify_token_by_token(form):
    """A block's bound takes its maxima of s and of the norms from different tokens: 20 runners-up
    (0.8x the winner's logit) one to a block, each beside a large-norm token orthogonal to the
    features, so the 5 blocks without a candidate bound above the winner and no row certifies by
    blocks; token by token every row does (the runner-up's and the big token's own bounds are both
    below), and `serving_argmax` answers the f32 argmax from there. Larger norms fail both: the f32
    head then answers."""
    target = tiny_target(vocab=8192, hidden=32, tie_word_embeddings=True)
    cfg = target.config
    u = np.random.default_rng(1).standard_normal(32).astype(np.float32)
    perp = np.random.default_rng(4).standard_normal(32).astype(np.float32)
    perp = perp - perp @ u / (u @ u) * u
    feats = jnp.asarray(u[None] + 0.01 * np.random.default_rng(3).standard_normal((4, 32)), jnp.float32)
    runners = np.arange(20) * 320 + 7
    for scale, by_token in ((1000, True), (5000, False)):
        e = 0.05 * np.random.default_rng(0).standard_normal((8192, 32)).astype(np.float32)
        e[5000], e[runners] = 4 * u, 3.2 * u
        e[runners + 1] = scale * perp / np.linalg.norm(perp)
        params = screen_params(dict(target.params, embed_tokens={"embedding": jnp.asarray(e)}), form)
        screen = llama.head_screen(params, cfg, 4)
        _, ok = screened(params, cfg, feats, screen, 16, False)
        tok, ok_token = screened(params, cfg, feats, screen, 16, True)
        assert not np.asarray(ok).any()
        assert np.asarray(ok_token).all() if by_token else not np.asarray(ok_token).any()
        want = f32_argmax(params, cfg, feats)
        assert (np.asarray(tok)[np.asarray(ok_token)] == want[np.asarray(ok_token)]).all()
        np.testing.assert_array_equal(np.asarray(serving_argmax(params, cfg, feats, screen)), want)


def test_greedy_decoding_with_the_screen_is_token_identical():
    """A tied tiny target (where the screen runs): ar at batch 2 (screened) equals ar one by one
    (one row: the f32 GEMV, or the kernel's screen where the CPU kernels run), and hsd with and
    without the screen equals ar."""
    target = tiny_target(vocab=64, tie_word_embeddings=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (5, 11)]
    alone = [generate(target, [p], max_new_tokens=24)[0].token_ids for p in prompts]
    assert [r.token_ids for r in generate(target, prompts, max_new_tokens=24)] == alone
    drafter = load_drafter("hsd", target=target, random_init=True, seed=1)
    for on in (True, False):
        res = generate(target, prompts, max_new_tokens=24, method="hsd", drafter=drafter, head_screen=on,
                       tree_nodes=6, tree_depth=3, tree_top_k=2)
        assert [r.token_ids for r in res] == alone


def test_the_screen_candidates_are_the_top_k_of_the_scores():
    """Two stages (the best blocks of 64 tokens by their maxima, then those blocks' tokens) pick the same
    ids as one top-k over the whole vocabulary, wherever the best scores cluster (all in one block,
    spread, ties aside); a vocabulary the blocks do not divide takes one top-k."""
    rng = np.random.default_rng(0)
    run = jax.jit(llama.screen_candidates, static_argnums=1)
    for v in (49152, 8192, 4100):
        s = rng.standard_normal((5, v)).astype(np.float32)
        s[1, 128:144] += 10.0                       # row 1: the 16 best in one block
        s[2, ::3000] += 10.0                        # row 2: one in each of many blocks
        got = np.sort(np.asarray(run(jnp.asarray(s), 16)), -1)
        want = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(s), 16)[1]), -1)
        np.testing.assert_array_equal(got, want)
