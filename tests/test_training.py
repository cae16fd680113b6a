"""Drafter training on a tiny target: loss falls and acceptance rises, kill -9 and resume, bad configs."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsd_jax.config import ConfigError
from hsd_jax.train.data import DataError, generate_data
from hsd_jax.train.trainer import TrainConfig, train
from tests.helpers import run_cli, save_hf_dir, tiny_target


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=64, hidden=32, layers=2, seed=3)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tiny):
    out = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, size=rng.integers(4, 16)).tolist() for _ in range(96)]
    n = generate_data(tiny, prompts, str(out), batch_size=32, max_new_tokens=28, temperature=0.0, progress=False)
    assert n == 96 * 28
    return str(out)


def test_chain_diagnostics_tell_a_copying_chain_from_a_working_one(tiny):
    """A drafter whose layer adds nothing copies its anchor: its feature error equals the copy
    baseline's and bypassing it changes no draft. A layer that moves the stream differs."""
    import jax.numpy as jnp

    from hsd_jax import load_drafter
    from hsd_jax.models import drafter as dmod
    from hsd_jax.train import losses
    from hsd_jax.train.trainer import chain_report
    from tests.helpers import zero_layers

    d = load_drafter("hsd", target=tiny, random_init=True)
    view = dmod.target_view(tiny.params, tiny.config, d.d2t)
    t2d = jnp.arange(64, dtype=jnp.int32)
    rng = np.random.default_rng(0)
    b, w = 4, 24
    batch = losses.Batch(jnp.asarray(rng.integers(0, 64, (b, w)), jnp.int32),
                         jnp.asarray(rng.normal(size=(b, w, 32)) * 3, jnp.float32),
                         jnp.asarray(np.arange(w)[None].repeat(b, 0) < w - 2), jnp.ones((b, w), bool))

    def report(params):
        sums = jax.jit(losses.chain_acceptance, static_argnames=("dcfg", "steps"))(params, d.config, view, t2d, batch, 3)
        return chain_report({k: np.asarray(v, np.float64) for k, v in sums.items()})

    copying = report(zero_layers(d.params))
    assert copying["feature_error_vs_copy"] == pytest.approx([1.0] * 3, abs=1e-4)
    assert copying["bypass_accept_by_depth"] == copying["accept_by_depth"]
    working = report(d.params)
    assert all(abs(r - 1.0) > 1e-3 for r in working["feature_error_vs_copy"])
    assert working["heldout_chains"] == copying["heldout_chains"] > 0


@pytest.mark.parametrize("layers", [1, 2])
def test_unrolled_chain_matches_the_engine_chain_steps(tiny, layers):
    """Step k of the training unroll at position q is the engine's chain: true features ingested up
    to q-k+1, then k-1 token-free steps, each of the drafter's layers attending to its own cache."""
    from hsd_jax.cache import init_cache
    from hsd_jax.models import drafter as dmod
    from hsd_jax.train import losses

    dcfg = dmod.DrafterConfig.for_target("hsd", tiny.config, num_layers=layers, feature_rms=3.0)
    params = dmod.init_drafter_params(dcfg, jax.random.key(4))
    rng = np.random.default_rng(1)
    w = 12
    feats = jnp.asarray(rng.normal(size=(1, w, tiny.config.hidden_size)) * 3, jnp.float32)
    batch = losses.Batch(jnp.asarray(rng.integers(0, 64, (1, w)), jnp.int32), feats, jnp.ones((1, w), bool),
                         jnp.ones((1, w), bool))
    outs = jax.jit(losses.unrolled_features, static_argnames=("dcfg", "steps"))(params, dcfg, None, batch, 3)
    run_layers = jax.jit(dmod.run_layers, static_argnames="cfg")   # eager, its many small ops dispatch one by one
    z = dmod.input_features(params, dcfg, feats, None)
    pos = jnp.arange(w, dtype=jnp.int32)[None]
    lcfg = dcfg.layer_config()
    for k in (1, 2, 3):
        for q in (k - 1, 5, w - 1):
            s = q - k + 1
            cache = init_cache(layers, 1, lcfg.num_kv_heads, 32, lcfg.head_dim)
            g, cache = run_layers(params, dcfg, z[:, : s + 1], pos[:, : s + 1], cache)
            cache, g = cache.replace(lengths=cache.lengths + s + 1), g[:, -1:]
            for j in range(1, k):
                g, cache = run_layers(params, dcfg, g, pos[:, s + j: s + j + 1], cache)
                cache = cache.replace(lengths=cache.lengths + 1)
            np.testing.assert_allclose(np.asarray(g[0, 0]), np.asarray(outs[k - 1][0, q]), rtol=1e-4, atol=1e-4,
                                       err_msg=f"{layers} layers, step {k} at {q}")


def test_soft_labels_are_the_target_distribution_over_the_draft_vocab(tiny):
    """A chain that reproduces the next feature exactly and a read-out equal to the target's head
    leave only the target distribution's own entropy as the soft-label loss (KL 0), at every step;
    with hard labels the same drafter pays the data token's surprisal instead."""
    import jax.numpy as jnp

    from hsd_jax import load_drafter
    from hsd_jax.models import drafter as dmod
    from hsd_jax.models.layers import rms_norm
    from hsd_jax.train import losses
    from tests.helpers import zero_layers

    d = load_drafter("hsd", target=tiny, random_init=True)
    params = zero_layers(d.params)   # g = z: with constant features the chain is exact
    view = dmod.target_view(tiny.params, tiny.config, d.d2t)
    t2d = jnp.arange(64, dtype=jnp.int32)
    rng = np.random.default_rng(1)
    b, w = 2, 12
    f = rng.normal(size=(32,)).astype(np.float32) * 3
    batch = losses.Batch(jnp.asarray(rng.integers(0, 64, (b, w)), jnp.int32), jnp.asarray(np.broadcast_to(f, (b, w, 32))),
                         jnp.asarray(np.arange(w)[None].repeat(b, 0) < w - 2), jnp.ones((b, w), bool))
    logits = np.asarray(rms_norm(jnp.asarray(f), view.norm_scale, 1e-5) @ view.head, np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    entropy = -(p * np.log(p)).sum()
    kw = dict(steps=3, ce_positions=6)
    soft = losses.LossWeights(feature=0.0, ce=1.0, soft_labels=True)
    loss = jax.jit(losses.drafter_loss, static_argnames=("dcfg", "steps", "ce_positions", "weights"))
    total, m = loss(params, d.config, view, t2d, batch, jax.random.key(0), weights=soft, **kw)
    for k in (1, 2, 3):
        assert float(m[f"ce_{k}"]) == pytest.approx(entropy, rel=1e-4)
        assert float(m[f"feat_{k}"]) == pytest.approx(0.0, abs=1e-6)
    assert float(total) == pytest.approx(entropy * (1 + 0.8 + 0.64), rel=1e-4)
    hard = losses.LossWeights(feature=0.0, ce=1.0)
    _, mh = loss(params, d.config, view, t2d, batch, jax.random.key(0), weights=hard, **kw)
    assert float(mh["ce_1"]) != pytest.approx(entropy, rel=1e-2)
    assert float(mh["ce_1"]) > -np.log(p.max()) - 1e-4   # a label's surprisal is at least the mode's


def test_readout_context_sees_the_path_tokens(tiny):
    """readout_context > 1: the read-out's extra inputs are the path's earlier tokens, they get
    gradient, the config is validated; the engine serves it for hsd (greedy identity with ar)
    and refuses it for eagle."""
    import jax.numpy as jnp

    from hsd_jax import generate, load_drafter
    from hsd_jax.api import InputError
    from hsd_jax.models import drafter as dmod
    from hsd_jax.train import losses

    toks = jnp.asarray([[5, 6, 7, 8]])
    assert losses.path_context(toks, 2).tolist() == [[[5, 5], [6, 5], [7, 6], [8, 7]]]
    with pytest.raises(ConfigError, match="readout_context"):
        dmod.DrafterConfig.for_target("hsd", tiny.config, readout_context=5)
    with pytest.raises(ConfigError, match="fused read-out"):
        dmod.DrafterConfig.for_target("hsd", tiny.config, injection="additive", readout_context=2)
    d = load_drafter("hsd", target=tiny, random_init=True, readout_context=3)
    assert d.params["inject"]["w1"].shape[0] == 4 * tiny.config.hidden_size
    d.params["inject"]["w2"] = jnp.full_like(d.params["inject"]["w2"], 0.01)  # let the read-out's MLP speak
    view = dmod.target_view(tiny.params, tiny.config, d.d2t)
    rng = np.random.default_rng(1)
    b, w = 2, 16
    batch = losses.Batch(jnp.asarray(rng.integers(0, 64, (b, w)), jnp.int32),
                         jnp.asarray(rng.normal(size=(b, w, 32)), jnp.float32), jnp.ones((b, w), bool),
                         jnp.ones((b, w), bool))

    def loss(p):
        return losses.drafter_loss(p, d.config, view, jnp.arange(64, dtype=jnp.int32), batch, jax.random.key(0),
                                   steps=2, ce_positions=6)[0]

    grad_w1 = jax.jit(jax.grad(loss))(d.params)["inject"]["w1"]
    d_ = tiny.config.hidden_size
    assert float(jnp.abs(grad_w1[2 * d_:]).sum()) > 0   # the context tokens' rows learn
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (1, 5, 12)]
    ref = [r.token_ids for r in generate(tiny, prompts, max_new_tokens=20)]
    for reuse in ("none", "refresh"):
        res = generate(tiny, prompts, max_new_tokens=20, method="hsd", drafter=d, reuse=reuse, tree_nodes=8,
                       tree_depth=3, tree_top_k=2)
        assert [r.token_ids for r in res] == ref
    eagle = load_drafter("eagle", target=tiny, random_init=True, readout_context=2)
    with pytest.raises(InputError, match="hsd only"):
        generate(tiny, [[1, 2, 3]], max_new_tokens=4, method="eagle", drafter=eagle)


def test_engine_feeds_the_read_out_each_node_s_path():
    """The tree hands every frontier node the tokens on its path before it, and the first read-out
    the committed tokens before the root (reaching into the prompt)."""
    import jax.numpy as jnp

    from hsd_jax import engine
    from hsd_jax.methods.hsd import recent_tokens
    from hsd_jax.tree import grow_tree

    prompt = jnp.asarray([[11, 12, 13, 0], [21, 22, 0, 0]])
    lens = jnp.asarray([3, 2])
    gen = jnp.asarray([[30, 31, 32, -1], [40, -1, -1, -1]])
    count = jnp.asarray([3, 1])            # newest committed: 32 and 40
    assert recent_tokens(prompt, lens, gen, count, 3).tolist() == [[31, 30, 13], [22, 21, 21]]

    spec = engine.SpecConfig(method="hsd", tree_nodes=10, tree_depth=3, tree_top_k=2)

    def children(j, ftok, fctx):  # a child's token encodes its parent's token and the parent's predecessor
        base = (ftok * 31 + fctx[..., 0] * 7) % 997
        return jnp.stack([base + c for c in range(2)], -1), jnp.stack([-0.1 * (c + 1) - j + 0 * ftok for c in range(2)], -1)

    root, root_ctx = jnp.asarray([5]), jnp.asarray([[4, 3]])
    first = (jnp.asarray([[50, 60]]), jnp.asarray([[-0.1, -0.2]]))
    tree = grow_tree(first, children, root, spec, root_ctx)
    tok, par = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
    checked = 0
    for i in range(1, len(tok)):
        p = par[i]
        if p <= 0:
            continue                       # depth 1: drawn by `first`
        before_p = tok[par[p]]             # the parent's predecessor on the path (the root for depth 1)
        assert (tok[i] - (tok[p] * 31 + before_p * 7) % 997) in (0, 1)
        checked += 1
    assert checked >= 4


def _cfg(tmp_path, data_dir, **kw):
    base = dict(kind="hsd", data_dir=data_dir, out_dir=str(tmp_path / "run"), steps=400, batch_size=8, window=40,
                unroll=2, ce_positions=8, learning_rate=1e-2, warmup_steps=10, draft_vocab_size=0,
                save_every=50, eval_every=1000, holdout_fraction=0.15, ce_weight=1.0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kind", ["hsd", "eagle"])
def test_training_lowers_loss_and_raises_acceptance(tmp_path, tiny, tiny_data, kind, monkeypatch):
    cfg = _cfg(tmp_path, tiny_data, kind=kind)
    final = train(cfg, target=tiny, progress=False, log=lambda *_: None)
    metrics = json.load(open(os.path.join(cfg.out_dir, "metrics.json")))
    untrained = metrics["history"][0]
    assert untrained["step"] == 0
    assert final["loss_last"] < 0.7 * final["loss_first"]
    assert final["accept_by_depth"][0] > untrained["accept_by_depth"][0] + 0.1
    assert len(final["bypass_accept_by_depth"]) == len(final["feature_error_vs_copy"]) == 2
    assert final["chain_tau_estimate"] > untrained["chain_tau_estimate"] + 0.1
    from hsd_jax import generate, load_drafter

    dr = load_drafter(kind, os.path.join(cfg.out_dir, "drafter"), target=tiny)
    prompt = [[5, 9, 33, 2, 17, 40]]
    ref = generate(tiny, prompt, max_new_tokens=24)[0]
    res = generate(tiny, prompt, max_new_tokens=24, method=kind, drafter=dr, tree_nodes=6, tree_depth=3,
                   tree_top_k=2)[0]
    assert res.token_ids == ref.token_ids and res.stats["tau"] > 1.1

    # shipping it: no file of the package copy names a directory of this machine (the run's, the data's)
    from hsd_jax.train import ship

    params = os.path.join(cfg.out_dir, "drafter", "params")
    assert not os.path.exists(os.path.join(params, "commit_success.txt"))  # save_drafter left Orbax's marker out
    with open(os.path.join(params, "commit_success.txt"), "w") as f:         # as drafters saved before wrote it
        f.write(f"Checkpoint commit was successful to {os.path.abspath(params)}")
    monkeypatch.setattr(ship, "SHIPPED_DRAFTERS", str(tmp_path / "package"))
    dst = ship.ship(cfg.out_dir, "tiny", kind, config_path="configs/train/x.yaml", command="hsd train")
    for dirpath, _, files in os.walk(dst):
        for name in files:
            data = open(os.path.join(dirpath, name), "rb").read()
            assert str(tmp_path).encode() not in data and tiny_data.encode() not in data, name
    shipped = load_drafter(kind, dst, target=tiny).params
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), shipped, dr.params)))


def test_eagle3_training_lowers_loss_serves_losslessly_and_exports(tmp_path, tiny, tiny_data):
    """`kind: eagle3`: the training-time-test unroll over fused target layers with the token loss
    learns (loss down, acceptance up), the drafter serves lossless generation, and its published
    export loads back to the same tokens."""
    from hsd_jax import generate, load_drafter
    from hsd_jax.api import export_eagle3

    cfg = _cfg(tmp_path, tiny_data, kind="eagle3", draft_vocab_size=48)
    final = train(cfg, target=tiny, progress=False, log=lambda *_: None)
    untrained = json.load(open(os.path.join(cfg.out_dir, "metrics.json")))["history"][0]
    assert json.load(open(os.path.join(cfg.out_dir, "train_config.json")))["feature_layers"] == [1, 0, 0]
    assert final["loss_last"] < 0.7 * final["loss_first"]
    # its own head is learnt from scratch on 2.7k tokens: it gains less than eagle's (frozen target head)
    assert final["accept_by_depth"][0] > untrained["accept_by_depth"][0] + 0.05
    assert final["chain_tau_estimate"] > untrained["chain_tau_estimate"] + 0.05
    assert "bypass_accept_by_depth" not in final
    dr = load_drafter("eagle3", os.path.join(cfg.out_dir, "drafter"), target=tiny)
    assert len(dr.d2t) == 48
    prompt = [[5, 9, 33, 2, 17, 40]]
    ref = generate(tiny, prompt, max_new_tokens=24)[0]
    kw = dict(max_new_tokens=24, method="eagle3", tree_nodes=6, tree_depth=3, tree_top_k=2)
    res = generate(tiny, prompt, drafter=dr, **kw)[0]
    assert res.token_ids == ref.token_ids and res.stats["tau"] > 1.0
    export_eagle3(os.path.join(cfg.out_dir, "drafter"), str(tmp_path / "published"))
    again = load_drafter("eagle3", str(tmp_path / "published"), target=tiny)
    assert generate(tiny, prompt, drafter=again, **kw)[0].stats["rounds"] == res.stats["rounds"]


def test_loss_weights_default_to_the_kinds_recipe_and_eagle3_can_regress_features(tmp_path, tiny):
    """Unset ce/feature weights take the kind's recipe (eagle3: token loss only, as published); an
    eagle3 run with `feature_weight` > 0 adds exactly the smooth-L1 distance of every unroll step's
    output from the next target feature, scaled by the feature RMS."""
    import optax

    from hsd_jax.models import eagle3
    from hsd_jax.train import losses

    weights = lambda kind, **kw: (lambda c: (c.ce_weight, c.feature_weight))(
        TrainConfig(kind=kind, data_dir="d", out_dir="o", **kw))
    assert weights("hsd") == weights("eagle") == (0.5, 1.0)
    assert weights("eagle3") == (1.0, 0.0)
    assert weights("eagle3", feature_weight=1.0) == (1.0, 1.0)
    assert weights("hsd", ce_weight=1.0, feature_weight=0.0) == (1.0, 0.0)

    cfg = eagle3.Eagle3Config.for_target(tiny.config, draft_vocab_size=48, feature_layers=(1, 0, 0))
    params = eagle3.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    b, w, d = 2, 12, tiny.config.hidden_size
    feats = rng.normal(0, 3.0, (b, w, d)).astype(np.float32)
    batch = losses.Batch(jnp.asarray(rng.integers(0, 64, (b, w)), jnp.int32), jnp.asarray(feats),
                         jnp.asarray(np.arange(w) < w - 2).repeat(b).reshape(w, b).T, jnp.ones((b, w), bool),
                         jnp.asarray(rng.normal(0, 3.0, (b, w, 3, d)), jnp.float32))
    t2d = jnp.asarray(np.where(np.arange(64) < 48, np.arange(64), -1), jnp.int32)
    table = tiny.params["embed_tokens"]["embedding"]
    loss = jax.jit(losses.eagle3_loss, static_argnames=("cfg", "steps", "ce_positions", "weights", "feature_rms"))
    run = lambda fw: loss(params, cfg, table, t2d, batch, jax.random.key(1), steps=2, ce_positions=4,
                          weights=losses.LossWeights(feature=fw, ce=1.0), feature_rms=3.0)
    (plain, m0), (both, m2) = run(0.0), run(2.0)
    assert "feat_1" not in m0
    outs = jax.jit(losses.unrolled_eagle3, static_argnames=("cfg", "steps"))(params, cfg, table, batch, 2)
    f_next = np.concatenate([feats[:, 1:], feats[:, -1:]], 1)
    valid = np.asarray(batch.valid)
    want = [float((np.asarray(optax.huber_loss((np.asarray(h) - f_next) / 3.0, delta=1.0)).mean(-1) * mk).sum()
                  / mk.sum()) for h, mk in zip(outs, (valid, valid & (np.arange(w) >= 1)))]
    np.testing.assert_allclose([float(m2["feat_1"]), float(m2["feat_2"])], want, rtol=1e-5)
    np.testing.assert_allclose(float(both) - float(plain), 2.0 * (want[0] + 0.8 * want[1]), rtol=1e-4)


def test_frozen_groups_keep_their_starting_values(tmp_path, tiny, tiny_data):
    """`frozen: [norm, lm_head]` trains an eagle3 drafter that reads out through the target's own
    final norm and LM head columns (where its head starts): those stay exact, the layer learns."""
    from hsd_jax import load_drafter
    from hsd_jax.models.llama import lm_head_weight

    with pytest.raises(ConfigError, match="list of parameter group names"):
        _cfg(tmp_path, tiny_data, kind="eagle3", frozen="lm_head")
    with pytest.raises(ConfigError, match=r"frozen names \['head'\]"):
        train(_cfg(tmp_path, tiny_data, kind="eagle3", draft_vocab_size=48, steps=3, frozen=["head"]), target=tiny,
              progress=False, log=lambda *_: None)
    cfg = _cfg(tmp_path, tiny_data, kind="eagle3", draft_vocab_size=48, steps=20, frozen=["norm", "lm_head"],
               eval_untrained=False, out_dir=str(tmp_path / "frozen"))
    final = train(cfg, target=tiny, progress=False, log=lambda *_: None)
    assert final["loss_last"] < final["loss_first"]
    dr = load_drafter("eagle3", os.path.join(cfg.out_dir, "drafter"), target=tiny)
    stored = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))   # drafters are saved in bf16
    head = np.take(np.asarray(lm_head_weight(tiny.params, tiny.config)), dr.d2t, axis=1)
    np.testing.assert_array_equal(np.asarray(dr.params["lm_head"]["kernel"]), stored(head))
    np.testing.assert_array_equal(np.asarray(dr.params["norm"]["scale"]), stored(tiny.params["norm"]["scale"]))


def test_training_a_drafter_that_fuses_several_target_layers(tmp_path, tiny, tiny_data):
    """`feature_layers`: the cache keeps those layers' outputs, the drafter's FC fuses them as its
    true-feature input, and the trained drafter serves lossless generation."""
    from hsd_jax import generate, load_drafter
    from hsd_jax.train.data import shard_paths
    from hsd_jax.train.features import aux_path

    with pytest.raises(ConfigError, match="feature_layers is implemented for hsd"):
        _cfg(tmp_path, tiny_data, kind="eagle", feature_layers=[0, 1])
    cfg = _cfg(tmp_path, tiny_data, steps=60, feature_layers=[0, 1], eval_every=1000)
    assert cfg.feature_layers == (0, 1)
    final = train(cfg, target=tiny, progress=False, log=lambda *_: None)
    assert final["loss_last"] < 0.8 * final["loss_first"]
    shard = shard_paths(tiny_data)[0]
    aux = np.load(aux_path(os.path.join(cfg.out_dir, "features"), shard, (0, 1)))
    assert aux.shape[2:] == (2, 32) and np.abs(aux).max() > 0
    d = load_drafter("hsd", os.path.join(cfg.out_dir, "drafter"), target=tiny)
    assert d.config.feature_layers == (0, 1) and d.params["fc"]["kernel"].shape == (64, 32)
    prompts = [[3, 9, 27, 17], [40, 2, 2, 8, 13]]
    ref = [r.token_ids for r in generate(tiny, prompts, max_new_tokens=12)]
    assert [r.token_ids for r in generate(tiny, prompts, max_new_tokens=12, method="hsd", drafter=d)] == ref
    with pytest.raises(ConfigError, match="feature layer 5"):
        train(_cfg(tmp_path, tiny_data, steps=2, feature_layers=[5], out_dir=str(tmp_path / "bad")), target=tiny,
              progress=False, log=lambda *_: None)


def _latest_step(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return 0
    steps = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()]
    return max(steps, default=0)


def test_kill_9_and_resume_continues_from_last_checkpoint(tmp_path, tiny, tiny_data):
    model_dir = tmp_path / "tiny_model"
    save_hf_dir(tiny, model_dir)
    cfg = _cfg(tmp_path, tiny_data, model=str(model_dir), steps=160, save_every=20, out_dir=str(tmp_path / "killed"))
    cfg_path = tmp_path / "cfg.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump({k: getattr(cfg, k) for k in cfg.__dataclass_fields__}))
    proc = subprocess.Popen([sys.executable, "-m", "hsd_jax", "train", "--config", str(cfg_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = os.path.join(cfg.out_dir, "checkpoints")
    deadline = time.time() + 400
    while _latest_step(ckpt) < 60 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = _latest_step(ckpt)
    assert 60 <= killed_at < 160
    logs = []
    resumed = train(TrainConfig.from_yaml(str(cfg_path)), target=tiny, progress=False, log=logs.append)
    assert any(f"resumed from step {killed_at}" in line for line in logs) or any(
        f"resumed from step {killed_at - 20}" in line for line in logs)
    assert resumed["step"] == 160
    straight_cfg = _cfg(tmp_path, tiny_data, model=str(model_dir), steps=160, save_every=20,
                        out_dir=str(tmp_path / "straight"))
    train(straight_cfg, target=tiny, progress=False, log=lambda *_: None)
    from hsd_jax import load_drafter

    a = load_drafter("hsd", os.path.join(cfg.out_dir, "drafter"), target=tiny).params
    b = load_drafter("hsd", os.path.join(straight_cfg.out_dir, "drafter"), target=tiny).params
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b))
    assert max(diffs) < 1e-2  # bf16 export of identical f32 training trajectories


def test_bad_training_configs_are_refused(tmp_path, tiny_data):
    with pytest.raises(ConfigError, match="not both 0"):
        _cfg(tmp_path, tiny_data, ce_weight=0.0, feature_weight=0.0)
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        _cfg(tmp_path, tiny_data, steps=0)
    with pytest.raises(ConfigError, match="drafter_layers is for hsd and eagle"):
        _cfg(tmp_path, tiny_data, kind="eagle3", drafter_layers=2)
    with pytest.raises(ConfigError, match="learning_rate must be > 0"):
        _cfg(tmp_path, tiny_data, learning_rate=-1e-3)
    with pytest.raises(DataError, match="no training data"):
        train(_cfg(tmp_path, str(tmp_path / "missing")), progress=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: hsd\ndata_dir: x\nout_dir: y\nsteps: 0\n")
    r = run_cli("train", "--config", str(bad))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: steps must be >= 1, got 0"]
    r = run_cli("train", "--config", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "training config not found" in r.stderr


def test_sd_draft_lm_training_and_shared_embeddings(tmp_path, tiny, tiny_data):
    cfg = _cfg(tmp_path, tiny_data, kind="sd", sd_layers=1, steps=200, learning_rate=1e-3)
    final = train(cfg, target=tiny, progress=False, log=lambda *_: None)
    untrained = json.load(open(os.path.join(cfg.out_dir, "metrics.json")))["history"][0]
    assert final["loss_last"] < final["loss_first"]
    assert final["accept_by_depth"][0] > untrained["accept_by_depth"][0]
    from hsd_jax import generate, load_drafter

    dr = load_drafter("sd", os.path.join(cfg.out_dir, "drafter"), target=tiny)
    assert dr.params["embed_tokens"]["embedding"] is tiny.params["embed_tokens"]["embedding"]
    prompt = [[3, 14, 15, 9, 26]]
    ref = generate(tiny, prompt, max_new_tokens=20)[0].token_ids
    assert generate(tiny, prompt, max_new_tokens=20, method="sd", drafter=dr, gamma=3)[0].token_ids == ref


def test_added_data_dir_keeps_held_out_split_and_resumed_vocab(tmp_path, tiny, tiny_data):
    from hsd_jax.train.data import existing_prompts
    from hsd_jax.train.trainer import SequenceData

    more = tmp_path / "more"
    rng = np.random.default_rng(1)
    fresh = [rng.integers(0, 64, size=9).tolist() for _ in range(40)]
    seen = existing_prompts(tiny_data)
    assert len(seen) == 96 and not any(tuple(p) in seen for p in fresh)
    generate_data(tiny, fresh, str(more), batch_size=20, max_new_tokens=12, progress=False)
    assert existing_prompts([tiny_data, str(more)]) == seen | {tuple(p) for p in fresh}

    one = SequenceData(tiny_data, None, 40, 0.15, seed=0)
    two = SequenceData([tiny_data, str(more)], None, 40, 0.15, seed=0)
    assert len(two.rows) == 96 + 40
    assert set(one.holdout) == {i for i in two.holdout if i < 96}  # the first dir's split is unchanged
    assert not set(two.holdout) & set(two.train) and len(two.holdout) + len(two.train) == 136
    # data_weights: a directory's share of the rows drawn follows its weight, not its size (~29% here)
    rng = np.random.default_rng(0)
    drawn = two.sample_train(rng, 4000, (1.0, 3.0))
    assert set(drawn) <= set(two.train) and abs(np.mean(drawn >= 96) - 0.75) < 0.03
    assert np.all(two.sample_train(rng, 50, (0.0, 1.0)) >= 96)
    # no weights: the draws earlier runs made (a resumed campaign keeps its data positions)
    np.testing.assert_array_equal(two.sample_train(np.random.default_rng(5), 8),
                                  np.random.default_rng(5).choice(two.train, size=8, replace=False))

    cfg = _cfg(tmp_path, tiny_data, steps=20, draft_vocab_size=16)
    train(cfg, target=tiny, progress=False, log=lambda *_: None)
    pinned = np.load(os.path.join(cfg.out_dir, "draft_vocab.npz"))
    np.testing.assert_array_equal(np.load(os.path.join(cfg.out_dir, "drafter", "d2t.npy")), pinned["d2t"])
    # a run that already has a vocabulary keeps it, whatever the data now holds
    grown = _cfg(tmp_path, [tiny_data, str(more)], steps=20, draft_vocab_size=16, out_dir=str(tmp_path / "grown"))
    assert grown.data_dirs == (tiny_data, str(more))
    os.makedirs(grown.out_dir)
    np.savez(os.path.join(grown.out_dir, "draft_vocab.npz"), d2t=np.arange(40, 56), feature_rms=1.5)
    train(grown, target=tiny, progress=False, log=lambda *_: None)
    np.testing.assert_array_equal(np.load(os.path.join(grown.out_dir, "drafter", "d2t.npy")), np.arange(40, 56))
    assert json.load(open(os.path.join(grown.out_dir, "drafter", "drafter.json")))["config"]["feature_rms"] == 1.5
    with pytest.raises(ConfigError, match="data_dir must be"):
        _cfg(tmp_path, [tiny_data, ""])
    for bad in ([1.0], [1.0, -1.0], [0, 0], 2.0, [1.0, "x"]):
        with pytest.raises(ConfigError, match="data_weights"):
            _cfg(tmp_path, [tiny_data, str(more)], data_weights=bad)
    weighted = _cfg(tmp_path, [tiny_data, str(more)], steps=2, draft_vocab_size=16, data_weights=[0, 1],
                    out_dir=str(tmp_path / "weighted"))
    assert weighted.data_weights == (0.0, 1.0)
    train(weighted, target=tiny, progress=False, log=lambda *_: None)


@pytest.mark.parametrize("args, message", [
    (["--sources", "foo"], "--sources must list gsm8k and/or sharegpt"),
    (["--sources", "sharegpt"], "--sources sharegpt needs --sharegpt"),
    (["--exclude", "/no/such/dir"], "--exclude directory not found"),
])
def test_data_generate_rejects_bad_arguments(tmp_path, args, message):
    r = run_cli("data", "generate", "--out", str(tmp_path / "d"), *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}")


def test_init_from_starts_where_the_given_drafter_ended(tmp_path, tiny, tiny_data):
    from hsd_jax import ModelLoadError

    base = _cfg(tmp_path, tiny_data, steps=150, draft_vocab_size=32, out_dir=str(tmp_path / "base"))
    done = train(base, target=tiny, progress=False, log=lambda *_: None)
    untrained = json.load(open(os.path.join(base.out_dir, "metrics.json")))["history"][0]
    drafter_dir = os.path.join(base.out_dir, "drafter")
    warm = _cfg(tmp_path, tiny_data, steps=2, draft_vocab_size=8, learning_rate=1e-6, init_from=drafter_dir,
                out_dir=str(tmp_path / "warm"))
    train(warm, target=tiny, progress=False, log=lambda *_: None)
    start = json.load(open(os.path.join(warm.out_dir, "metrics.json")))["history"][0]
    assert start["step"] == 0
    assert start["accept_by_depth"][0] > untrained["accept_by_depth"][0] + 0.1
    assert abs(start["accept_by_depth"][0] - done["accept_by_depth"][0]) < 0.05  # bf16 export of the same weights
    # the vocabulary and feature scale come from the given drafter, not from draft_vocab_size
    np.testing.assert_array_equal(np.load(os.path.join(warm.out_dir, "draft_vocab.npz"))["d2t"],
                                  np.load(os.path.join(drafter_dir, "d2t.npy")))
    with pytest.raises(ConfigError, match="init_from must be a drafter directory"):
        _cfg(tmp_path, tiny_data, init_from=str(tmp_path / "nothing"))
    with pytest.raises(ModelLoadError, match="holds a 'hsd' drafter"):
        train(_cfg(tmp_path, tiny_data, kind="eagle", steps=2, init_from=drafter_dir, out_dir=str(tmp_path / "e")),
              target=tiny, progress=False, log=lambda *_: None)
    with pytest.raises(ConfigError, match=r"differs in \['injection'\]"):
        train(_cfg(tmp_path, tiny_data, steps=2, injection="additive", init_from=drafter_dir, out_dir=str(tmp_path / "i")),
              target=tiny, progress=False, log=lambda *_: None)


def test_bf16_matmul_inputs_in_forward_and_gradients():
    """`matmul_inputs`: both matmuls of the backward pass run on bf16 inputs too (JAX's own transpose of a
    mixed dot would run them in f32), accumulating in f32; outside the context nothing changes."""
    from hsd_jax.models.layers import matmul, matmul_inputs

    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (3, 5, 16)), jax.random.normal(kw, (16, 8))
    loss = lambda x, w: jnp.sum(jnp.sin(matmul(x, w)))
    ref, ref_grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
    np.testing.assert_allclose(ref, jnp.sum(jnp.sin(x @ w)), rtol=1e-6)

    def mixed(x, w):
        with matmul_inputs(jnp.bfloat16):
            return loss(x, w)
    val, (gx, gw) = jax.jit(jax.value_and_grad(mixed, (0, 1)))(x, w)
    assert "bf16" in jax.jit(jax.grad(mixed)).lower(x, w).as_text()
    b16 = lambda a: a.astype(jnp.bfloat16)
    y = jnp.dot(b16(x), b16(w), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(val, jnp.sum(jnp.sin(y)), rtol=1e-5)
    gy = jnp.cos(y)
    np.testing.assert_allclose(gx, jnp.dot(b16(gy), b16(w).T, preferred_element_type=jnp.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, jnp.dot(b16(x).reshape(-1, 16).T, b16(gy).reshape(-1, 8),
                                           preferred_element_type=jnp.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, ref_grads[0], rtol=0.05, atol=0.1)   # f32's gradients within bf16 rounding
    assert not np.array_equal(np.asarray(gx), np.asarray(ref_grads[0]))


def test_text_rows_train_on_the_target_s_own_labels(tmp_path, tiny, tiny_data):
    """`hsd data text` rows (text the target did not write): the feature cache adds the target's greedy next
    token at every position, batches carry it, the loss drafts it; their held-out rows are never evaluated."""
    from hsd_jax.train import losses
    from hsd_jax.train.data import has_target_labels, shard_paths, write_text_data
    from hsd_jax.train.features import (
        FEATURE_SPAN,
        _features,
        build_feature_cache,
        cache_complete,
        feature_path,
        label_path,
    )
    from hsd_jax.train.trainer import SequenceData
    from tests.helpers import jax_logits

    rng = np.random.default_rng(5)
    pairs = [(rng.integers(0, 64, 6).tolist(), rng.integers(0, 64, int(rng.integers(10, 30))).tolist())
             for _ in range(40)]
    text, cache = str(tmp_path / "text"), str(tmp_path / "cache")
    assert write_text_data(tiny, pairs, text, shard_size=16, progress=False) == sum(len(r) for _, r in pairs)
    shards = shard_paths(text)
    assert len(shards) == 3 and all(has_target_labels(s) for s in shards)
    assert not has_target_labels(shard_paths(tiny_data)[0])
    assert not cache_complete(text, cache)
    for d in (tiny_data, text):
        build_feature_cache(tiny, d, cache, progress=False)
        assert cache_complete(d, cache)
    assert not os.path.exists(label_path(cache, shard_paths(tiny_data)[0]))
    with np.load(shards[0]) as z:
        row, n = z["tokens"][0], int(z["lengths"][0])
    lab = np.load(label_path(cache, shards[0]))
    np.testing.assert_array_equal(lab[0, :n], np.argmax(jax_logits(tiny.params, tiny.config, row[None, :n])[0], -1))
    # rows of several lengths prefill in batches padded to their own longest: each row's cached features
    # are its own forward's (alone, padded past its end)
    with np.load(shards[0]) as z:
        toks0, lens0 = z["tokens"], z["lengths"]
    assert len(set(lens0.tolist())) > 4
    cached = np.load(feature_path(cache, shards[0]))
    alone = np.zeros((len(toks0), FEATURE_SPAN * -(-toks0.shape[1] // FEATURE_SPAN)), np.int32)
    for r, m in enumerate(lens0):
        alone[r, :m] = toks0[r, :m]
    ref = np.asarray(_features(tiny.params, tiny.config, jnp.asarray(alone))[0], np.float32)
    for r, m in enumerate(lens0):
        np.testing.assert_allclose(cached[r, :m], ref[r, :m], atol=2e-3, rtol=2e-3)

    data = SequenceData([tiny_data, text], cache, 40, 0.15, seed=0)
    assert set(data.holdout) == set(SequenceData(tiny_data, cache, 40, 0.15, seed=0).holdout)  # text: none held out
    assert len(data.train) == (96 - 14) + (40 - 6)
    own = next(r for r in data.train if r < 96)
    other = next(r for r in data.train if r >= 96)
    b = data.batch(np.array([own, other]))
    toks, _, i, _, _, lmm = data.rows[other]
    start = max(0, len(toks) - 40)
    np.testing.assert_array_equal(np.asarray(b.labels[1, : len(toks) - start]), lmm[i, start: len(toks)])
    mine = data.rows[own][0][-40:]
    np.testing.assert_array_equal(np.asarray(b.labels[0, : len(mine) - 1]), mine[1:])
    got = np.asarray(losses.train_labels(b))
    np.testing.assert_array_equal(got[0, : len(mine) - 2], mine[2:])   # the data's x_{q+2} where the target wrote it
    np.testing.assert_array_equal(got[1, : len(toks) - start - 1], lmm[i, start + 1: len(toks)])

    with pytest.raises(ConfigError, match="built with float32 matmul inputs"):
        build_feature_cache(tiny, text, cache, matmul_dtype="bfloat16", progress=False)
    f32, _, _ = _features(tiny.params, tiny.config, jnp.asarray(row[None, :16]))
    b16, _, _ = _features(tiny.params, tiny.config, jnp.asarray(row[None, :16]), jnp.bfloat16)
    err = float(jnp.sqrt(jnp.mean(jnp.square(b16.astype(jnp.float32) - f32.astype(jnp.float32)))))
    assert 0 < err < 0.05 * float(jnp.sqrt(jnp.mean(jnp.square(f32.astype(jnp.float32)))))


def test_a_run_in_chunks_and_continued_on_a_new_machine(tmp_path, tiny, tiny_data):
    """`until_step` stops a run without changing its schedule; the curve (history.jsonl) spans the chunks;
    `start_step` continues the schedule from an exported drafter alone (a committed campaign state)."""
    import dataclasses

    quiet = dict(target=tiny, progress=False, log=lambda *_: None)
    cfg = _cfg(tmp_path, tiny_data, steps=60, draft_vocab_size=16, compute_dtype="bfloat16")
    first = train(cfg, until_step=25, **quiet)
    assert first["step"] == 25 and _latest_step(os.path.join(cfg.out_dir, "checkpoints")) == 25
    second = train(cfg, **quiet)
    assert second["step"] == 60 and second["loss_last"] < first["loss_first"]
    curve = [json.loads(line)["step"] for line in open(os.path.join(cfg.out_dir, "history.jsonl"))]
    assert curve == [0, 25, 60]
    assert [h["step"] for h in json.load(open(os.path.join(cfg.out_dir, "metrics.json")))["history"]] == [0, 25]
    with pytest.raises(ConfigError, match="nothing to do"):
        train(cfg, **quiet)

    cont = dataclasses.replace(cfg, out_dir=str(tmp_path / "cont"), init_from=os.path.join(cfg.out_dir, "drafter"),
                               start_step=25)
    third = train(cont, until_step=40, **quiet)
    assert third["step"] == 40
    assert [json.loads(line)["step"] for line in open(os.path.join(cont.out_dir, "history.jsonl"))] == [40]
    with pytest.raises(ConfigError, match="start_step"):
        _cfg(tmp_path, tiny_data, start_step=5)
    with pytest.raises(ConfigError, match="compute_dtype"):
        _cfg(tmp_path, tiny_data, compute_dtype="float16")


def test_campaign_new_machine_keeps_committed_curve(tmp_path, monkeypatch):
    """scripts/campaign.py on a machine without the run directory: the chunk it commits next still holds
    the curve committed before (the run directory's history.jsonl starts with it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("campaign", os.path.join(os.path.dirname(__file__), "..",
                                                                           "scripts", "campaign.py"))
    campaign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(campaign)
    monkeypatch.setattr(campaign, "STATE", str(tmp_path / "state"))
    curve = [{"step": 0, "accept_by_depth": [0.4]}, {"step": 250, "accept_by_depth": [0.45]}]
    os.makedirs(tmp_path / "state" / "hsd")
    json.dump({"kind": "hsd", "step": 250, "history": curve}, open(tmp_path / "state" / "hsd" / "state.json", "w"))
    run = tmp_path / "runs" / "hsd"
    campaign.seed_history("hsd", str(run))
    with open(run / "history.jsonl", "a") as f:   # what train() appends after its chunk
        f.write(json.dumps({"step": 500, "accept_by_depth": [0.5]}) + "\n")
    os.makedirs(run / "drafter")
    campaign.commit_state("hsd", str(run), 500)
    state = json.load(open(tmp_path / "state" / "hsd" / "state.json"))
    assert state["step"] == 500 and [p["step"] for p in state["history"]] == [0, 250, 500]
    campaign.seed_history("eagle", str(tmp_path / "runs" / "eagle"))   # nothing committed: nothing seeded
    assert not os.path.exists(tmp_path / "runs" / "eagle")


def test_campaign_ships_from_the_committed_state_on_a_new_machine(tmp_path, tiny_data, monkeypatch):
    """`campaign.py --ship` where the run directory is gone: the drafter, config, curve and the data's token
    counts come from the committed state and the config; the card says the losses stayed behind."""
    import importlib.util

    import hsd_jax.train.ship as ship_mod
    from hsd_jax.train.data import load_shards

    spec = importlib.util.spec_from_file_location("campaign", os.path.join(os.path.dirname(__file__), "..",
                                                                           "scripts", "campaign.py"))
    campaign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(campaign)
    monkeypatch.setattr(campaign, "STATE", str(tmp_path / "state"))
    monkeypatch.setattr(ship_mod, "SHIPPED_DRAFTERS", str(tmp_path / "package"))
    curve = [{"step": s, "accept_by_depth": [a], "chain_tau_estimate": 1.5} for s, a in ((0, 0.4), (250, 0.42), (500, 0.45))]
    os.makedirs(tmp_path / "state" / "hsd" / "drafter")
    (tmp_path / "state" / "hsd" / "drafter" / "drafter.json").write_text("{}")
    json.dump({"kind": "hsd", "step": 500, "history": curve}, open(tmp_path / "state" / "hsd" / "state.json", "w"))
    config = tmp_path / "campaign_hsd.yaml"
    config.write_text(f"kind: hsd\ndata_dir: [{tiny_data}]\nsteps: 500\nbatch_size: 8\nwindow: 40\n")
    run = campaign.run_from_state("hsd", str(config), str(tmp_path / "runs" / "hsd-committed"))
    dst = ship_mod.ship(run, "tiny", "hsd", config_path=str(config), command="campaign")
    card = open(os.path.join(dst, "MODEL_CARD.md")).read()
    seqs, plens = load_shards([tiny_data])
    assert f"{sum(len(s) for s in seqs)} tokens in all, {sum(len(s) - p for s, p in zip(seqs, plens))} of them" in card
    assert "| 500 | [0.45] | 1.5 |" in card and "| 250 | [0.42] | 1.5 |" in card
    assert "shipped from the committed state" in card and "loss:" not in card
    assert os.path.isfile(os.path.join(dst, "drafter.json"))


def test_a_long_learning_curve_is_thinned_to_round_steps_on_the_card():
    """A campaign's 72-point curve goes on its card at every 1000 steps; a short one whole."""
    from hsd_jax.train.ship import _thinned

    curve = [{"step": s} for s in range(0, 18000, 250)]
    assert [h["step"] for h in _thinned(curve)] == list(range(0, 18000, 1000))
    assert _thinned(curve[:12]) == curve[:12]
