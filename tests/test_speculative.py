"""Speculative engine on a tiny random target: losslessness, bookkeeping, batching, reuse, errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax import generate, load_drafter
from hsd_jax.api import InputError
from hsd_jax.config import ConfigError
from hsd_jax.models.drafter import Drafter
from tests.helpers import bigram_target, jax_logits, tiny_target, zero_layers

METHODS = [("hsd", dict(reuse="none")), ("hsd", dict(reuse="chain")), ("hsd", dict(reuse="refresh")),
           ("eagle", {}), ("eagle3", {}), ("sd", {}), ("ngram", {}), ("lookup", {})]
# + prompt-lookup nodes; hsd's with its unlikely drafts pruned too
HYBRID = [("hsd", dict(lookup_slots=3, lookup_min_match=2, min_draft_prob=0.2)),
          ("eagle", dict(lookup_slots=2, lookup_min_match=0))]


def _chain(method):
    from hsd_jax.methods import REGISTRY

    return method in REGISTRY and REGISTRY[method].drafts == "chain"


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=64)


@pytest.fixture(scope="module")
def drafters(tiny):
    return {k: load_drafter(k, target=tiny, random_init=True, seed=1) for k in ("hsd", "eagle", "eagle3", "sd", "ngram", "lookup")}


@pytest.mark.parametrize("method, opts", METHODS + HYBRID)
def test_greedy_equals_ar_on_random_prompts_batched_or_one_by_one(tiny, drafters, method, opts):
    """T=0 output equals ar for every tree (or chain) shape; at the first shape each prompt decoded
    alone gives the same tokens, acceptance and drafter work as in the batch (one padded length,
    so the batch and the single row run the same rounds)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (1, 6, 13, 21)]
    ref = [r.token_ids for r in generate(tiny, prompts, max_new_tokens=30, prompt_bucket=32)]
    shapes = [dict(tree_nodes=6, tree_depth=3, tree_top_k=2), dict(tree_nodes=12, tree_depth=5, tree_top_k=3)]
    if _chain(method):
        shapes = [dict(gamma=2), dict(gamma=5)]
    for i, shape in enumerate(shapes):
        kw = dict(max_new_tokens=30, method=method, drafter=drafters[method], prompt_bucket=32, **opts, **shape)
        res = generate(tiny, prompts, **kw)
        assert [r.token_ids for r in res] == ref
        for r in res:
            assert r.stats["rounds"] + 1 == r.stats["target_forwards"]
            assert sum(r.stats["accepted_hist"]) == r.stats["rounds"]
        if opts.get("min_draft_prob"):   # some rows pruned (the random drafter is rarely sure)
            width = shape["tree_nodes"] + 1 + opts.get("lookup_slots", 0)
            assert sum(r.stats["verified_slots"] for r in res) < sum(r.stats["rounds"] for r in res) * width
        if i == 0 and (method, opts) in METHODS:
            for p, r in zip(prompts[1:], res[1:]):
                alone = generate(tiny, [p], **kw)[0]
                assert r.token_ids == alone.token_ids
                assert r.stats["accepted_hist"] == alone.stats["accepted_hist"]
                assert r.stats["drafter_forwards"] == alone.stats["drafter_forwards"]


def _oracle_drafters(tgt):
    """Drafters that always guess the bigram target's next token: (drafter, options) pairs."""
    d = tgt.config.hidden_size
    hsd = load_drafter("hsd", target=tgt, random_init=True, injection="additive", feature_rms=1e4)
    hsd.params = dict(zero_layers(hsd.params), inject={"w": jnp.eye(d)})
    eagle = load_drafter("eagle", target=tgt, random_init=True, readout="plain")
    eagle.params = dict(zero_layers(eagle.params), fc={"kernel": jnp.concatenate([jnp.zeros((d, d)), jnp.eye(d)])})
    # the n-gram floor counted from the target's own greedy continuations of every token
    from hsd_jax.models.ngram import NgramConfig, bigram_table

    firsts = [[t] for t in range(tgt.config.vocab_size)]
    seqs = [np.array(p + r.token_ids) for p, r in zip(firsts, generate(tgt, firsts, max_new_tokens=4))]
    ncfg = NgramConfig(vocab_size=tgt.config.vocab_size, top_k=2)
    ngram = Drafter("ngram", bigram_table(seqs, [1] * len(seqs), ncfg), ncfg)
    return [(hsd, dict(reuse="chain")), (hsd, dict(reuse="none")), (hsd, dict(reuse="refresh")), (eagle, {}),
            (ngram, {})]


def test_oracle_drafters_reach_full_acceptance():
    tgt = bigram_target()
    depth, rounds = 4, 6
    n_new = 1 + rounds * (depth + 1)
    prompt = [[5, 17, 3]]
    ref = generate(tgt, prompt, max_new_tokens=n_new)[0].token_ids
    for dr, opts in _oracle_drafters(tgt):
        if opts.get("reuse") == "refresh":
            continue
        r = generate(tgt, prompt, max_new_tokens=n_new, method=dr.kind, drafter=dr,
                     tree_nodes=8, tree_depth=depth, tree_top_k=2, **opts)[0]
        assert r.token_ids == ref
        assert r.stats["tau"] == depth + 1 and r.stats["rounds"] == rounds
        assert r.stats["accepted_hist"] == [0] * depth + [rounds]
    sd = Drafter("sd", tgt.params, tgt.config)
    gamma = 3
    r = generate(tgt, prompt, max_new_tokens=1 + 5 * (gamma + 1), method="sd", drafter=sd, gamma=gamma)[0]
    assert r.token_ids == generate(tgt, prompt, max_new_tokens=1 + 5 * (gamma + 1))[0].token_ids
    assert r.stats["tau"] == gamma + 1 and r.stats["accepted_hist"] == [0] * gamma + [5]


def test_eos_inside_an_accepted_round_stops_there_for_every_method():
    """With drafters that are always right, EOS falls in the middle of an accepted run of drafts:
    the sequence must end exactly where ar ends it, while its batch-mate runs on."""
    tgt = bigram_target()
    n_new = 1 + 4 * 5
    starts = [[9, t] for t in range(64)]  # the next token depends on the last one only
    conts = [r.token_ids for r in generate(tgt, starts, max_new_tokens=n_new)]
    # a continuation whose token 3 or 4 is new: as EOS it ends the sequence inside round 1
    # (round 1 commits new tokens 2..6 at depth 4)
    first, k, other = next((i, k, j) for i, c in enumerate(conts) for k in (2, 3) if c[k] not in c[:k]
                           for j, o in enumerate(conts) if c[k] not in o)
    eos = conts[first][k]
    tgt.config = tgt.config.replace(eos_token_ids=(eos,))
    prompts = [starts[first], starts[other]]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=n_new)]
    assert ref[0] == conts[first][: k + 1] and len(ref[1]) == n_new   # mixed finish
    sd = (Drafter("sd", tgt.params, tgt.config), dict(gamma=4))
    lookup = (load_drafter("lookup", target=tgt), dict(gamma=4))
    for dr, opts in _oracle_drafters(tgt) + [sd, lookup]:
        tree = {} if dr.kind in ("sd", "lookup") else dict(tree_nodes=8, tree_depth=4, tree_top_k=2)
        res = generate(tgt, prompts, max_new_tokens=n_new, method=dr.kind, drafter=dr, **opts, **tree)
        assert [r.token_ids for r in res] == ref, (dr.kind, opts)
        assert res[0].stats["new_tokens"] == k + 1


@pytest.mark.parametrize("method, opts", METHODS)
def test_bf16_generate_matches_bf16_ar(method, opts):
    """The accelerator default dtype end to end: drafters (random, cast to bf16 at load) beside a
    bf16 target, every method token-identical to bf16 ar on this target."""
    tgt = tiny_target(vocab=64, dtype="bfloat16", seed=2)
    drafter = load_drafter(method, target=tgt, random_init=True, seed=1)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 11)]
    ref = [r.token_ids for r in generate(tgt, prompts, max_new_tokens=16)]
    shape = dict(gamma=3) if _chain(method) else dict(tree_nodes=6, tree_depth=3, tree_top_k=2)
    res = generate(tgt, prompts, max_new_tokens=16, method=method, drafter=drafter, **opts, **shape)
    assert [r.token_ids for r in res] == ref


def test_chain_reuse_runs_fewer_drafter_steps(tiny, drafters):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 64, size=8).tolist() for _ in range(3)]
    kw = dict(max_new_tokens=32, method="hsd", drafter=drafters["hsd"], tree_nodes=10, tree_depth=5, tree_top_k=3)
    runs = {reuse: generate(tiny, prompts, reuse=reuse, **kw) for reuse in ("none", "refresh", "chain")}
    steps = {reuse: sum(r.stats["drafter_forwards"] for r in res) / sum(r.stats["new_tokens"] for r in res)
             for reuse, res in runs.items()}
    assert steps["chain"] < 0.7 * steps["none"]
    assert steps["chain"] < steps["refresh"] < steps["none"]   # refresh re-runs the depth-2 state, not the rest
    assert [r.token_ids for r in runs["none"]] == [r.token_ids for r in runs["chain"]] == [
        r.token_ids for r in runs["refresh"]]


def test_a_chain_step_run_for_other_rows_leaves_a_row_that_does_not_need_it_as_it_was(tiny, drafters):
    """`chain_extend` runs a step when any row needs it; a row whose reused chain starts later keeps
    its chain and its drafter cache, as when it runs alone, so it drafts the same in any batch."""
    from hsd_jax.cache import init_cache
    from hsd_jax.methods.hsd import chain_extend

    dr = drafters["hsd"]
    d = tiny.config.hidden_size
    rng = np.random.default_rng(0)
    lcfg = dr.config.layer_config()
    cache = init_cache(lcfg.num_layers, 2, lcfg.num_kv_heads, 32, lcfg.head_dim)
    cache = cache.replace(k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                          v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32),
                          lengths=jnp.array([5, 9], jnp.int32))
    chain = jnp.asarray(rng.normal(size=(2, 4, d)), jnp.float32)
    both, both_cache, steps = chain_extend(dr.params, dr.config, cache, chain, jnp.array([0, 2]))
    assert steps.tolist() == [3, 1]
    row = lambda c, i: c.replace(k=c.k[:, i:i + 1], v=c.v[:, i:i + 1], lengths=c.lengths[i:i + 1])
    alone, alone_cache, _ = chain_extend(dr.params, dr.config, row(cache, 1), chain[1:], jnp.array([2]))
    np.testing.assert_array_equal(np.asarray(both[1, :3]), np.asarray(chain[1, :3]))   # kept: untouched
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    close(both[1], alone[0])               # the step it needs: equal up to the batch shape's rounding
    close(row(both_cache, 1).k, alone_cache.k)
    close(row(both_cache, 1).v, alone_cache.v)


@pytest.mark.parametrize("method, opts", [("hsd", dict(reuse="none")), ("eagle", {}), ("eagle3", {})])
def test_the_decode_loop_writes_the_drafter_cache_in_place(method, opts):
    """No copy of the drafter's whole KV cache inside the compiled decode loop (CPU kernels: head size
    16): a chain step that put its scratch slot back (hsd) or a tree step whose written cache was
    dropped (eagle) made XLA copy it per step, ~1.9 ms a round at capacity 8192 on SmolLM2."""
    import re

    from hsd_jax import api, cpu_kernels, engine

    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels are not built here")
    target = tiny_target(vocab=64, hidden=64)
    api._COMPILED.clear()
    generate(target, [[3, 9, 27]], max_new_tokens=8, method=method, tree_nodes=6, tree_depth=3, tree_top_k=2,
             drafter=load_drafter(method, target=target, random_init=True, seed=1), **opts)
    [text] = [exe.as_text() for key, exe in api._COMPILED.items() if key[0] is engine.spec_decode]
    shape = re.search(r"pre_dstate_cache_k\S* = (f32\[[\d,]+\])", text).group(1)   # the drafter's K
    loops = [c for c in re.split(r"\n(?=\S)", text) if not c.startswith("ENTRY") and "fused" not in c.split(" ", 1)[0]]
    copies = [line for c in loops for line in c.splitlines() if f"= {shape}" in line and " copy(" in line]
    assert any(f"{shape}" in c for c in loops) and copies == []


def _exact_marginals(tgt, prompt, n_pos, temperature, top_k=0, top_p=1.0):
    """Exact distribution of each of the first n_pos sampled tokens, by enumerating prefixes."""
    from hsd_jax.config import SamplingConfig
    from hsd_jax.sampling import target_probs

    sampling = SamplingConfig(temperature, top_k, top_p)
    v = tgt.config.vocab_size
    marg = np.zeros((n_pos, v))
    probs = {(): 1.0}
    for pos in range(n_pos):
        nxt = {}
        prefixes = list(probs)
        logits = jax_logits(tgt.params, tgt.config, [prompt + list(p) for p in prefixes])[:, -1]
        dist = np.asarray(target_probs(jnp.asarray(logits), sampling), np.float64)
        for p, row in zip(prefixes, dist):
            for t in range(v):
                nxt[p + (t,)] = probs[p] * row[t]
        probs = nxt
        for p, pr in probs.items():
            marg[pos, p[-1]] += pr
    return marg


CHI2_CRIT_7DOF = 24.32  # p = 1e-3 for 7 degrees of freedom (vocab 8)


@pytest.mark.parametrize("method, opts", METHODS + HYBRID + [("ar", {})])
def test_sampling_preserves_target_distribution(method, opts):
    check_sampling_distribution(tiny_target(vocab=8, hidden=16, heads=2, kv_heads=1, seed=4, max_cache_len=64),
                                method, opts)


def check_sampling_distribution(tgt, method, opts):
    """T=1 samples of 3 tokens after a fixed prompt (3000 rows) follow the exact marginals of a
    vocabulary-8 target (chi-square, p = 1e-3 per position)."""
    prompt, n_samples, n_pos, temp = [1, 5, 2], 3000, 3, 1.0
    if opts.get("lookup_slots"):
        prompt = prompt + [1, 5]   # a 2-token lookup match in the first round, none in some later ones
    exact = _exact_marginals(tgt, prompt, n_pos, temp)
    dr = None if method == "ar" else load_drafter(method, target=tgt, random_init=True, seed=2)
    shape = dict(gamma=2) if _chain(method) else dict(tree_nodes=5, tree_depth=2, tree_top_k=3)
    res = generate(tgt, [prompt] * n_samples, max_new_tokens=n_pos, temperature=temp, seed=123,
                   method=method, drafter=dr, **({} if method == "ar" else dict(opts, **shape)))
    toks = np.array([r.token_ids for r in res])
    assert toks.shape == (n_samples, n_pos)
    if opts.get("lookup_slots"):   # rounds with and without the lookup nodes, unless asked for in every round
        share = sum(r.stats["lookup_rounds"] for r in res) / sum(r.stats["rounds"] for r in res)
        assert share == 1.0 if opts.get("lookup_min_match") == 0 else 0 < share < 1, share
    for pos in range(n_pos):
        observed = np.bincount(toks[:, pos], minlength=8)
        expected = exact[pos] * n_samples
        chi2 = ((observed - expected) ** 2 / expected).sum()
        assert chi2 < CHI2_CRIT_7DOF, (pos, chi2, observed, expected.round(1))


@pytest.mark.parametrize("method, opts, trunc", [("hsd", {}, dict(top_k=3)), ("eagle", {}, dict(top_p=0.8)),
                                                 ("sd", {}, dict(top_k=4, top_p=0.9))])
def test_sampling_with_top_k_top_p_preserves_the_truncated_distribution(method, opts, trunc):
    """Speculative acceptance against the target's top-k / top-p distribution: samples follow it
    exactly (tokens outside it never appear), with draft trees and sampled SD chains."""
    from scipy.stats import chi2 as chi2_dist

    tgt = tiny_target(vocab=8, hidden=16, heads=2, kv_heads=1, seed=4, max_cache_len=64)
    prompt, n_samples, n_pos, temp = [1, 5, 2], 3000, 2, 1.0
    exact = _exact_marginals(tgt, prompt, n_pos, temp, **trunc)
    dr = load_drafter(method, target=tgt, random_init=True, seed=2)
    shape = dict(gamma=2) if _chain(method) else dict(tree_nodes=5, tree_depth=2, tree_top_k=3)
    res = generate(tgt, [prompt] * n_samples, max_new_tokens=n_pos, temperature=temp, seed=7, method=method,
                   drafter=dr, top_k=trunc.get("top_k", 0), top_p=trunc.get("top_p", 1.0), **opts, **shape)
    toks = np.array([r.token_ids for r in res])
    for pos in range(n_pos):
        observed = np.bincount(toks[:, pos], minlength=8)
        expected = exact[pos] * n_samples
        support = expected > 1e-9
        assert observed[~support].sum() == 0 and support.sum() < 8, (pos, observed, expected.round(1))
        chi2 = ((observed[support] - expected[support]) ** 2 / expected[support]).sum()
        assert chi2 < chi2_dist.ppf(1 - 1e-3, support.sum() - 1), (pos, chi2, observed, expected.round(1))


def test_mismatched_drafter_is_refused(tiny):
    other = tiny_target(hidden=48, heads=4, kv_heads=2)
    d = load_drafter("hsd", target=other, random_init=True)
    with pytest.raises(ConfigError, match="hidden size 48 does not match the target's 32"):
        d.config.check_target(tiny.config)
    with pytest.raises(ConfigError, match="feature layer 7"):
        load_drafter("hsd", target=tiny, random_init=True, feature_layers=(0, 7))
    with pytest.raises(ConfigError, match="vocab"):
        load_drafter("sd", target=tiny, random_init=True, vocab_size=65)


def test_bad_speculative_input_is_refused(tiny, drafters):
    from hsd_jax.loading.errors import ModelLoadError

    with pytest.raises(InputError, match="needs a drafter"):
        generate(tiny, [[1, 2]], method="hsd")
    with pytest.raises(InputError, match="needs a 'hsd' drafter"):
        generate(tiny, [[1, 2]], method="hsd", drafter=drafters["eagle"])
    with pytest.raises(InputError, match="draft tree"):  # 200 + 50 fits the 256 cache, the tree's slots do not
        generate(tiny, [[1] * 200], max_new_tokens=50, method="hsd", drafter=drafters["hsd"], tree_nodes=8,
                 tree_depth=4, tree_top_k=3)
    with pytest.raises(ConfigError, match="exceeds the"):
        generate(tiny, [[1, 2]], method="hsd", drafter=drafters["hsd"], tree_nodes=40, tree_depth=2, tree_top_k=2)
    with pytest.raises(InputError, match="unknown options"):
        generate(tiny, [[1, 2]], method="hsd", drafter=drafters["hsd"], tree_width=3)
    with pytest.raises(ModelLoadError, match="random_init=True"):
        load_drafter("hsd", target=tiny)


def test_drafter_save_load_round_trip(tmp_path, tiny, drafters):
    from hsd_jax import save_drafter
    from hsd_jax.loading.errors import ModelLoadError

    for kind in ("hsd", "eagle", "sd", "ngram", "lookup"):
        d = drafters[kind]
        save_drafter(d, str(tmp_path / kind))
        back = load_drafter(kind, str(tmp_path / kind), target=tiny)
        assert back.config == d.config
        for dirpath, _, files in os.walk(tmp_path / kind):  # nothing written names the directory it went to
            for f in files:
                assert str(tmp_path).encode() not in open(os.path.join(dirpath, f), "rb").read(), f
        same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), d.params, back.params)
        assert all(jax.tree.leaves(same))
    with pytest.raises(ModelLoadError, match="holds a 'hsd' drafter"):
        load_drafter("eagle", str(tmp_path / "hsd"), target=tiny)
    with pytest.raises(ModelLoadError, match="not a drafter directory"):
        load_drafter("hsd", str(tmp_path), target=tiny)


@pytest.mark.parametrize("method, tree", [("eagle", dict(tree_nodes=10, tree_depth=6, tree_top_k=6)),
                                          ("hsd", dict(tree_nodes=10, tree_depth=4, tree_top_k=4))])
def test_runs_at_the_cache_limit_stay_lossless(method, tree):
    """A request that fills the cache exactly (prompt + new tokens + the round's slack, eagle's
    drafter scratch included) runs and matches ar; one token more is refused."""
    from hsd_jax.engine import SpecConfig

    tgt = tiny_target(vocab=64, max_cache_len=96)
    slack = SpecConfig(method=method, **tree).cache_slack
    if method == "eagle":
        assert slack == (tree["tree_depth"] - 1) * tree["tree_top_k"] > tree["tree_nodes"] + 1 + tree["tree_depth"] + 1
    new = 24
    prompt = list(np.random.default_rng(0).integers(0, 64, 96 - new - slack))
    d = load_drafter(method, target=tgt, random_init=True)
    ref = generate(tgt, [prompt], max_new_tokens=new)[0].token_ids
    assert generate(tgt, [prompt], max_new_tokens=new, method=method, drafter=d, **tree)[0].token_ids == ref
    with pytest.raises(InputError, match="exceeds the cache capacity"):
        generate(tgt, [prompt + [1]], max_new_tokens=new, method=method, drafter=d, **tree)
