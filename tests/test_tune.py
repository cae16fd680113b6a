"""hsd tune: measures, picks the fastest tree and reuse policy, and generate then uses them."""
import json

import pytest

from hsd_jax import generate, load_drafter, tune, tuning
from hsd_jax.config import ConfigError, InputError
from hsd_jax.engine import BACKEND_DEFAULTS, SpecConfig, spec_defaults
from hsd_jax.methods import REGISTRY
from tests.helpers import tiny_target


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path))
    return tmp_path / "tuned"


def test_candidate_trees_are_valid_and_bounded():
    from hsd_jax.engine import SpecConfig

    for max_nodes in (2, 8, 47):
        grid = tune.candidate_trees(max_nodes)
        assert grid and all(t["tree_nodes"] <= max_nodes for t in grid)
        assert len({tuple(sorted(t.items())) for t in grid}) == len(grid)
        for t in grid:
            SpecConfig(method="hsd", **t)
    assert {"tree_nodes": 1, "tree_depth": 1, "tree_top_k": 1} in tune.candidate_trees(2)


def test_tune_writes_the_fastest_tree_and_generate_uses_it_when_asked(tuned_dir):
    target = tiny_target(vocab=64)
    drafter = load_drafter("hsd", target=target, random_init=True)
    grid = [dict(tree_nodes=2, tree_depth=2, tree_top_k=1), dict(tree_nodes=6, tree_depth=3, tree_top_k=2)]
    curve = tune.verify_cost_curve(target, sizes=(1, 2, 8), repeats=2)   # the default's 11 sizes: 11 compiles
    report = tune.tune(target, drafter, [[3, 9, 27, 17], [40, 2, 2, 8]], grid=grid, max_new_tokens=8, finalists=1,
                       lookup_slots=(2,), lookup_min_match=(0, 2), curve=curve, log=lambda s: None)

    files = list(tuned_dir.iterdir())
    assert [str(f) for f in files] == [report["path"]]
    assert files[0].name.startswith(f"{tuning.hardware_key()}--") and "--hsd-" in files[0].name
    saved = json.loads(files[0].read_text())
    assert saved["tree"] == report["tree"] and '": "/' not in files[0].read_text()  # no machine paths
    assert len(report["grid"]) == 2 and len(report["finalists"]) == 1 + 3 * 2  # ar + 1 tree x 3 reuse x 2 matches
    assert report["finalists"]["ar"]["speedup_vs_ar"] == 1.0
    best = max((n for n in report["finalists"] if n != "ar"), key=lambda n: report["finalists"][n]["speedup_vs_ar"])
    tree = report["tree"]
    m, least = report["lookup_slots"], report["lookup_min_match"]
    assert best == (f"{tree['tree_nodes']}/{tree['tree_depth']}/{tree['tree_top_k']} {report['reuse']}"
                    + f" +lookup{m}/{least}")
    assert len(report["acceptance_by_depth"]) == 4 and all(0 <= a <= 1 for a in report["acceptance_by_depth"])
    assert list(report["verify_cost_ms"]) == [1, 2, 8] and all(ms > 0 for ms in report["verify_cost_ms"].values())

    stats = generate(target, [[5, 6, 7]], max_new_tokens=6, method="hsd", drafter=drafter, tuned=True)[0].stats
    assert stats["reuse"] == report["reuse"] and stats["lookup_slots"] == m and stats["lookup_min_match"] == least
    assert (stats["tree_nodes"], stats["tree_depth"], stats["tree_top_k"]) == tuple(report["tree"].values())
    plain = generate(target, [[5, 6, 7]], max_new_tokens=6, method="hsd", drafter=drafter)[0].stats
    d = SpecConfig(**spec_defaults("hsd", "cpu"))   # untuned: the platform's row of BACKEND_DEFAULTS
    assert (plain["tree_nodes"], plain["tree_depth"], plain["tree_top_k"], plain["reuse"], plain["lookup_slots"]) == (
        d.tree_nodes, d.tree_depth, d.tree_top_k, d.reuse, d.lookup_slots)
    # another drafter (a different config) does not inherit this one's tree
    other = load_drafter("hsd", target=target, random_init=True, draft_vocab_size=32)
    with pytest.raises(InputError, match="hsd tune --method hsd"):
        generate(target, [[5, 6, 7]], max_new_tokens=6, method="hsd", drafter=other, tuned=True)


def test_acceptance_by_depth_is_one_for_an_oracle_drafter_and_low_for_a_random_one():
    import jax.numpy as jnp

    from tests.helpers import bigram_target, zero_layers

    target = bigram_target()
    oracle = load_drafter("hsd", target=target, random_init=True, injection="additive", feature_rms=1e4)
    oracle.params = dict(zero_layers(oracle.params), inject={"w": jnp.eye(target.config.hidden_size)})
    prompts = [[5, 17, 3], [40, 2, 2, 8]]
    assert tune.acceptance_by_depth(target, oracle, prompts, 16, depth=3) == [1.0, 1.0, 1.0]
    rand = tune.acceptance_by_depth(target, load_drafter("hsd", target=target, random_init=True), prompts, 16, 3)
    assert rand[0] < 0.5


def test_tuned_trees_live_in_the_user_cache_keyed_by_hardware_model_and_drafter(tuned_dir, monkeypatch):
    target = tiny_target(vocab=64)
    d1 = load_drafter("hsd", target=target, random_init=True)
    e1 = load_drafter("eagle", target=target, random_init=True)
    assert tuning.tuned_path(target, d1).startswith(str(tuned_dir))
    assert tuning.tuned_path(target, d1) != tuning.tuned_path(target, e1)
    assert tuning.load_tuned(target, d1) is None
    monkeypatch.delenv("HSD_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tuned_dir / "xdg"))
    assert tuning.cache_dir() == str(tuned_dir / "xdg" / "hsd_jax" / "tuned")


def test_the_timed_verify_is_the_engines_greedy_verdict():
    """`hsd tune` times the head the greedy engine runs (the bf16 screen over 2+ rows), and it
    names the f32 argmax."""
    import numpy as np

    from hsd_jax.models import llama

    target = tiny_target(vocab=64, tie_word_embeddings=True)
    cfg, params = target.config, target.params
    greedy, f32 = tune.in_place(tune.verify_program(cfg)), tune.in_place(tune.verify_program(cfg, greedy=False))
    for n in (1, 3, 8):
        args = tune.verify_inputs(cfg, n, context=5)
        screen = llama.head_screen(params, cfg, n)
        assert (screen is None) == (n == 1)
        out = greedy(params, *args, screen)
        tokens, certified = out if screen is not None else (out, np.ones(n, bool))
        assert np.asarray(certified).all()
        np.testing.assert_array_equal(np.ravel(tokens), np.ravel(np.argmax(f32(params, *args, None), -1)))


def test_the_timed_verify_writes_its_cache_in_place():
    """The timed verify donates its cache (a decode loop's write in place, not a whole-cache copy per
    call); `in_place` copies a caller's cache once and keeps what each call wrote, lengths unchanged."""
    import numpy as np

    target = tiny_target(vocab=64)
    cfg, params = target.config, target.params
    tokens, positions, cache, parents = tune.verify_inputs(cfg, 3, context=5)
    written = tune.verify_program(cfg)(params, tokens, positions, cache, parents, None)[1]
    assert cache.k.is_deleted() and int(written.lengths[0]) == 5
    assert np.abs(np.asarray(written.k[:, 0, :, 5:8])).sum() > 0 and not np.asarray(written.k[:, 0, :, 8:]).any()
    tokens, positions, cache, parents = tune.verify_inputs(cfg, 3, context=5)
    verify = tune.in_place(tune.verify_program(cfg))
    first = verify(params, tokens, positions, cache, parents, None)
    np.testing.assert_array_equal(first, verify(params, tokens, positions, cache, parents, None))
    assert not cache.k.is_deleted() and not np.asarray(cache.k).any()


def test_backend_defaults_fill_only_what_a_request_leaves_out():
    assert spec_defaults("hsd", "cpu") == BACKEND_DEFAULTS["cpu"] and spec_defaults("eagle", "gpu") == {}
    assert spec_defaults("hsd", "cuda") == spec_defaults("hsd", "tpu") == {}   # accelerators: SpecConfig's 8/4/3
    assert spec_defaults("sd", "cpu") == spec_defaults("lookup", "cpu") == {}   # chain methods take no tree
    # a row is one preset: a request that sets any of its fields takes none of it
    assert spec_defaults("hsd", "cpu", {"tree_depth": 4}) == spec_defaults("ngram", "cpu", {"lookup_slots": 0}) == {}
    assert spec_defaults("hsd", "cpu", {"reuse": "chain"}) == BACKEND_DEFAULTS["cpu"]
    with pytest.raises(ConfigError, match="platform 'metal'"):
        spec_defaults("hsd", "metal")
    for platform in BACKEND_DEFAULTS:   # every row builds a valid spec for every method
        for method in REGISTRY:
            SpecConfig(method=method, **spec_defaults(method, platform))

    from tests.helpers import bigram_target

    target = bigram_target()
    drafter = load_drafter("hsd", target=target, random_init=True)
    stats = generate(target, [[5, 6, 7]], max_new_tokens=4, method="hsd", drafter=drafter, tree_depth=3,
                     tree_nodes=5)[0].stats
    assert (stats["tree_nodes"], stats["tree_depth"], stats["tree_top_k"], stats["lookup_slots"]) == (
        5, 3, SpecConfig.tree_top_k, SpecConfig.lookup_slots)   # explicit options win, the rest is SpecConfig's
