"""`generate(..., exact=N)`: ar's steps and every method's verify at one row width. On the CPU in f32
the outputs were identical already; what is checked here is that exact keeps them so (ar against
itself, methods of other verify widths against ar), that the programs really run N-row forwards,
and that a width a method's tree does not fit in is refused. bf16 identity itself is measured on
an accelerator (benchmarks/device, part `exact`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import InputError, engine, generate, load_drafter
from hsd_jax.api import exact_rows, programs
from hsd_jax.config import SamplingConfig
from hsd_jax.models import llama
from pallas_kernels.tree_attention import tree_attention
from tests.helpers import run_cli, tiny_target

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=64, seed=3)


def test_exact_keeps_ar_and_methods_of_other_widths_identical_in_f32(tiny):
    ar = [r.token_ids for r in generate(tiny, PROMPTS, max_new_tokens=16)]
    exact_ar = generate(tiny, PROMPTS, max_new_tokens=16, exact=12)
    assert [r.token_ids for r in exact_ar] == ar and exact_ar[0].stats["exact_rows"] == 12
    for kind, opts in (("sd", dict(gamma=3)), ("hsd", dict(tree_nodes=6, tree_depth=3, tree_top_k=2))):
        drafter = load_drafter(kind, target=tiny, random_init=True)
        res = generate(tiny, PROMPTS, max_new_tokens=16, method=kind, drafter=drafter, exact=12, **opts)
        assert [r.token_ids for r in res] == ar, kind
        # the padding slots are neither accepted nor counted as verified rows
        assert all(r.stats["verified_slots"] == r.stats["rounds"] * engine.SpecConfig(method=kind, **opts).verify_slots
                   for r in res)


def test_exact_keeps_bf16_methods_identical_to_bf16_ar_with_positional_attention():
    """bf16 (no CPU kernels: XLA's dots and exact's positional attention) on a tiny target: under
    exact, tree and chain methods give ar's tokens."""
    tgt = tiny_target(vocab=64, dtype="bfloat16", seed=5)
    ar = [r.token_ids for r in generate(tgt, PROMPTS, max_new_tokens=16, exact=12)]
    for kind, opts in (("sd", dict(gamma=3)), ("hsd", dict(tree_nodes=6, tree_depth=3, tree_top_k=2))):
        drafter = load_drafter(kind, target=tgt, random_init=True)
        res = generate(tgt, PROMPTS, max_new_tokens=16, method=kind, drafter=drafter, exact=12, **opts)
        assert [r.token_ids for r in res] == ar, kind


def test_positional_attention_is_the_reference_and_does_not_depend_on_the_slot_layout():
    """Same semantics as the reference; and a path's rows give bitwise the same output whether the
    path sits at contiguous slots (a chain, as in ar's cache) or between decoy siblings (a tree)."""
    rng = np.random.default_rng(0)
    b, hq, hkv, n, s, dh = 1, 4, 2, 5, 32, 16
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, k, v = normal(b, hq, n, dh), normal(b, hkv, s, dh), normal(b, hkv, s, dh)
    lengths = jnp.array([9])
    for parents in ([[-1, 0, 0, 1, 2]], [[-1, 0, 1, 1, -1]], [[-1, -1, -1, -1, -1]]):
        parents = jnp.array(parents)
        np.testing.assert_allclose(tree_attention(q, k, v, lengths, parents, impl="positional"),
                                   tree_attention(q, k, v, lengths, parents, impl="reference"), rtol=1e-5, atol=1e-5)
    chain, tree = [0, 1, 2], [0, 2, 4]          # the path's slots in each layout; 1 and 3: decoys in the tree
    q_chain, k_chain, v_chain = q, k, v
    q_tree = q.at[:, :, jnp.array(tree)].set(q[:, :, jnp.array(chain)])
    k_tree = k.at[:, :, 9 + jnp.array(tree)].set(k[:, :, 9 + jnp.array(chain)])
    v_tree = v.at[:, :, 9 + jnp.array(tree)].set(v[:, :, 9 + jnp.array(chain)])
    out_chain = tree_attention(q_chain, k_chain, v_chain, lengths, jnp.array([[-1, 0, 1, -1, -1]]), impl="positional")
    out_tree = tree_attention(q_tree, k_tree, v_tree, lengths, jnp.array([[-1, 0, 0, 2, 2]]), impl="positional")
    assert np.array_equal(np.asarray(out_chain[:, :, jnp.array(chain)]), np.asarray(out_tree[:, :, jnp.array(tree)]))


def test_exact_programs_run_their_target_forwards_at_n_rows(tiny):
    """The decode loops' lowered programs hold [B, N, d] activations (the N-row forward), which
    the default programs do not."""
    d = tiny.config.hidden_size
    sampling = SamplingConfig()
    shape = f"tensor<2x12x{d}xf32>"
    drafter = load_drafter("sd", target=tiny, random_init=True)
    spec = engine.SpecConfig(method="sd", gamma=3)
    for spec_, dr in ((None, None), (spec, drafter)):
        texts = {}
        for rows in (0, 12):
            progs = programs(tiny, spec_, dr, sampling, rows=rows)
            args = (*progs.weights, np.zeros((2, 16), np.int32), np.array([7, 3], np.int32), jax.random.key(0))
            pre = jax.eval_shape(lambda *a: progs.prefill(*a, **progs.prefill_static), *args)
            texts[rows] = progs.decode.lower(*progs.weights, pre, np.int32(8), **progs.decode_static).as_text()
        assert shape in texts[12] and shape not in texts[0], spec_


def test_an_exact_step_computes_the_token_as_a_one_row_step_does(tiny):
    """Row 0 of `decode_forward`'s N-row forward is the token (f32: equal to the 1-row step within
    rounding); the padding leaves the committed cache as one row does."""
    cfg = tiny.config
    _, out = llama.prefill_new_cache(tiny.params, cfg, jnp.array([PROMPTS[0]]), jnp.array([7]), 32)
    one = engine.decode_forward(tiny.params, cfg, jnp.array([11]), out.cache, 1)
    wide = engine.decode_forward(tiny.params, cfg, jnp.array([11]), out.cache, 6)
    assert wide.features.shape == (1, 6, cfg.hidden_size)
    np.testing.assert_allclose(wide.features[:, 0], one.features[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(wide.cache.k[:, :, :, :8], one.cache.k[:, :, :, :8], rtol=1e-5, atol=1e-5)


def test_exact_widths_a_tree_does_not_fit_in_are_refused(tiny):
    hsd = engine.SpecConfig(method="hsd")   # 8 nodes + the root
    assert exact_rows(False, hsd) == 0 and exact_rows(True, hsd) == engine.EXACT_ROWS and exact_rows(9, hsd) == 9
    assert exact_rows(1, None) == 1
    with pytest.raises(InputError, match="exact=N with N >= 9"):
        exact_rows(4, hsd)
    for bad in (0, -3, "yes", 2.5):
        with pytest.raises(InputError, match="exact must be"):
            exact_rows(bad, None)
    drafter = load_drafter("hsd", target=tiny, random_init=True)
    with pytest.raises(InputError, match="narrower"):
        generate(tiny, PROMPTS, max_new_tokens=4, method="hsd", drafter=drafter, exact=5)
    with pytest.raises(InputError, match="cache capacity"):    # the padded rows need their scratch slots
        generate(tiny, PROMPTS, max_new_tokens=256 - 7 - 20, exact=32)
    # the CLI refuses it before loading a model, for the tree generate would run (this platform's preset)
    slots = engine.SpecConfig(method="hsd", **engine.spec_defaults("hsd", jax.default_backend(), {})).verify_slots
    proc = run_cli("generate", "--prompt", "hi", "--method", "hsd", "--random-drafter", "--exact", str(slots - 1))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and f"exact=N with N >= {slots}" in proc.stderr
