"""Sharded runs on 8 fake CPU devices: every mesh gives the single-device greedy tokens (ar, hsd,
Pallas attention per shard), a sharded training step gives the single-device loss, weights and KV
caches are really split, and bad meshes get clear errors.

The checks run in one child process (this file as a script) because the fake device count must
be set before JAX starts; the tests below read its JSON report.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ((1, 8), (2, 4), (8, 1))   # model axis only, both, data axis only
SPEC = dict(tree_nodes=6, tree_depth=3, tree_top_k=2, reuse="chain")


def _prompts(n, vocab, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(3, 14))).tolist() for _ in range(n)]


def _ids(results):
    return [r.token_ids for r in results]


def _error(fn):
    from hsd_jax.config import ConfigError

    try:
        fn()
    except ConfigError as e:
        return str(e)
    return None


def check_generate(report):
    """ar and hsd on every mesh against one device (tiny target, 8 heads / 8 KV heads, batch 8)."""
    from hsd_jax import generate, load_drafter, sharding
    from tests.helpers import tiny_target

    t = tiny_target(vocab=64, layers=2, heads=8, kv_heads=8, hidden=64, seed=1)
    d = load_drafter("hsd", target=t, random_init=True)
    prompts = _prompts(8, 64)
    ref_ar = _ids(generate(t, prompts, max_new_tokens=16))
    ref_hsd = _ids(generate(t, prompts, max_new_tokens=16, method="hsd", drafter=d, **SPEC))
    report["ref_hsd_matches_ar"] = ref_hsd == ref_ar
    for data, model in MESHES:
        mesh = sharding.make_mesh(data, model)
        ar = _ids(generate(t, prompts, max_new_tokens=16, mesh=mesh))
        hsd = _ids(generate(t, prompts, max_new_tokens=16, method="hsd", drafter=d, mesh=mesh, **SPEC))
        report[f"generate_{data}x{model}"] = {"ar": ar == ref_ar, "hsd": hsd == ref_hsd}
    ng = load_drafter("ngram", target=t, random_init=True, top_k=SPEC["tree_top_k"])
    ref_ng = _ids(generate(t, prompts, max_new_tokens=16, method="ngram", drafter=ng, **SPEC))
    on_mesh = _ids(generate(t, prompts, max_new_tokens=16, method="ngram", drafter=ng, mesh=sharding.make_mesh(2, 4),
                            **SPEC))
    report["ngram_2x4"] = {"single_matches_ar": ref_ng == ref_ar, "mesh_matches_single": on_mesh == ref_ng}
    e3 = load_drafter("eagle3", target=t, random_init=True, draft_vocab_size=48)
    spec = dict(tree_nodes=6, tree_depth=3, tree_top_k=2)
    ref_e3 = _ids(generate(t, prompts, max_new_tokens=16, method="eagle3", drafter=e3, **spec))
    on_mesh = _ids(generate(t, prompts, max_new_tokens=16, method="eagle3", drafter=e3, mesh=sharding.make_mesh(2, 4),
                            **spec))
    report["eagle3_2x4"] = {"single_matches_ar": ref_e3 == ref_ar, "mesh_matches_single": on_mesh == ref_e3}


def check_pallas(report):
    """Pallas tree attention (interpret mode on CPU) per shard under shard_map, GQA 8/4 on 2x4."""
    import jax
    import jax.numpy as jnp

    from hsd_jax import generate, load_drafter, sharding
    from pallas_kernels.tree_attention import tree_attention
    from tests.helpers import tiny_target

    t = tiny_target(vocab=64, layers=2, heads=8, kv_heads=4, hidden=64, seed=2)
    t.config = t.config.replace(attention_impl="pallas")
    d = load_drafter("hsd", target=t, random_init=True)
    prompts = _prompts(4, 64, seed=1)
    mesh = sharding.make_mesh(2, 4)
    ref_ar = _ids(generate(t, prompts, max_new_tokens=12))
    ref_hsd = _ids(generate(t, prompts, max_new_tokens=12, method="hsd", drafter=d, **SPEC))
    ar = _ids(generate(t, prompts, max_new_tokens=12, mesh=mesh))
    hsd = _ids(generate(t, prompts, max_new_tokens=12, method="hsd", drafter=d, mesh=mesh, **SPEC))
    q, kv = jnp.zeros((4, 8, 3, 8)), jnp.zeros((4, 4, 16, 8))
    lens, parents = jnp.zeros((4,), jnp.int32), jnp.full((4, 3), -1, jnp.int32)
    with sharding.use_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda *a: tree_attention(*a, impl="pallas"))(q, kv, kv, lens, parents))
    report["pallas_2x4"] = {"ar": ar == ref_ar, "hsd": hsd == ref_hsd, "shard_map": "shard_map" in jaxpr}


def check_qwen3(report):
    """A Qwen3-shaped target (per-head q/k norms with random scales, head_dim 16 != 64 / 8) on a 2x4
    mesh with Pallas tree attention per shard (hsd's verify): single-device ar's tokens; the head
    norms (shared by every head) stay whole on every device."""
    import jax
    import numpy as np

    from hsd_jax import generate, load_drafter, sharding
    from tests.helpers import tiny_target

    t = tiny_target(vocab=64, layers=2, heads=8, kv_heads=4, hidden=64, seed=3, head_dim=16, qk_norm=True)
    layers = dict(t.params["layers"])
    for i, k in enumerate(("q_norm", "k_norm")):
        layers[k] = {"scale": 1.0 + 0.5 * jax.random.normal(jax.random.key(i), layers[k]["scale"].shape)}
    t.params = dict(t.params, layers=layers)
    d = load_drafter("hsd", target=t, random_init=True)
    prompts = _prompts(4, 64, seed=2)
    ref = _ids(generate(t, prompts, max_new_tokens=12))
    t.config = t.config.replace(attention_impl="pallas")
    mesh = sharding.make_mesh(2, 4)
    hsd = _ids(generate(t, prompts, max_new_tokens=12, method="hsd", drafter=d, mesh=mesh, **SPEC))
    placed = sharding.shard_params(jax.tree.map(np.asarray, t.params), mesh)["layers"]
    report["qwen3_2x4"] = {"hsd": hsd == ref,
                           "q_norm_replicated": placed["q_norm"]["scale"].sharding.is_fully_replicated,
                           "q_proj_split": not placed["q_proj"]["kernel"].sharding.is_fully_replicated}


def check_placement(report):
    """Weights and KV caches are split across devices as the rules say."""
    import jax
    import numpy as np

    from hsd_jax import load_drafter, sharding
    from hsd_jax.cache import init_cache
    from tests.helpers import tiny_target

    t = tiny_target(vocab=64, layers=2, heads=8, kv_heads=8, hidden=64, seed=1)
    d = load_drafter("hsd", target=t, random_init=True)
    mesh = sharding.make_mesh(2, 4)
    host = jax.tree.map(np.asarray, t.params)
    p = sharding.shard_params(host, mesh)
    dp = sharding.shard_params(d.params, mesh)
    e3 = sharding.shard_params(load_drafter("eagle3", target=t, random_init=True).params, mesh)

    def shards(x):
        spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
        return {"spec": spec, "n": len(x.addressable_shards),
                "shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards})}

    with sharding.use_mesh(mesh):
        cache = jax.jit(lambda: init_cache(2, 8, 8, 32, 8))()
    report["placement"] = {
        "q_proj": shards(p["layers"]["q_proj"]["kernel"]), "o_proj": shards(p["layers"]["o_proj"]["kernel"]),
        "down_proj": shards(p["layers"]["mlp"]["down_proj"]["kernel"]),
        "embedding": shards(p["embed_tokens"]["embedding"]), "lm_head": shards(p["lm_head"]["kernel"]),
        "norm": shards(p["norm"]["scale"]), "inject_w1": shards(dp["inject"]["w1"]),
        "eagle3_q": shards(e3["midlayer"]["q_proj"]["kernel"]), "eagle3_o": shards(e3["midlayer"]["o_proj"]["kernel"]),
        "cache_k": shards(cache.k), "cache_lengths": shards(cache.lengths),
        "values_kept": bool(np.array_equal(np.asarray(p["layers"]["q_proj"]["kernel"]),
                                           host["layers"]["q_proj"]["kernel"])),
    }


def check_training(report):
    """One optimizer step of the HSD drafter loss, sharded (2x4, 8x1) vs one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from hsd_jax import load_drafter, sharding
    from hsd_jax.models import drafter as dmod
    from hsd_jax.train import losses
    from hsd_jax.train.trainer import make_train_step
    from tests.helpers import tiny_target

    t = tiny_target(vocab=64, layers=2, heads=8, kv_heads=8, hidden=64, seed=1)
    d = load_drafter("hsd", target=t, random_init=True)
    rng = np.random.default_rng(0)
    b, w = 8, 24
    valid = np.ones((b, w), bool)
    valid[:, -2:] = False
    batch = losses.Batch(jnp.asarray(rng.integers(0, 64, (b, w)), jnp.int32),
                         jnp.asarray(rng.normal(size=(b, w, 64)), jnp.float32), jnp.asarray(valid),
                         jnp.asarray(np.ones((b, w), bool)))
    t2d = jnp.arange(64, dtype=jnp.int32)
    tx = optax.adamw(1e-2, eps=1e-3)   # eps keeps Adam's near-zero-gradient steps from amplifying float noise
    key = jax.random.key(0)

    def run(tparams, params, batch, mesh=None):
        view = dmod.target_view(tparams, t.config, d.d2t)

        def loss(p, bt, k):
            return losses.drafter_loss(p, d.config, view, t2d, bt, k, steps=2, ce_positions=6)

        state = {"params": params, "opt": tx.init(params)}
        if mesh is not None:
            state = sharding.shard_params(state, mesh)
        new, metrics = make_train_step(loss, tx, state if mesh is not None else None)(state, batch, key)
        return new, float(metrics["loss"])

    ref_state, ref_loss = run(t.params, d.params, batch)
    out = {"loss": ref_loss}
    for data, model in ((2, 4), (8, 1)):
        mesh = sharding.make_mesh(data, model)
        sb = jax.tree.map(lambda x: sharding.shard_batch(x, mesh), batch)
        new, loss = run(sharding.shard_params(t.params, mesh), d.params, sb, mesh)
        diff = max(float(jnp.max(jnp.abs(a - np.asarray(r))))
                   for a, r in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(ref_state["params"])))
        out[f"{data}x{model}"] = {"loss": loss, "max_param_diff": diff,
                                  "q_spec": list(new["params"]["layers"]["q_proj"]["kernel"].sharding.spec),
                                  "adam_mu_spec": list(new["opt"][0].mu["layers"]["q_proj"]["kernel"].sharding.spec)}
    report["training"] = out


def check_train_run(report):
    """`train(cfg, mesh=...)` end to end (3 steps, checkpoint, eval, export) matches one device."""
    import tempfile

    from hsd_jax import sharding
    from hsd_jax.train.data import generate_data
    from hsd_jax.train.trainer import TrainConfig, train
    from tests.helpers import tiny_target

    t = tiny_target(vocab=64, layers=2, heads=8, kv_heads=8, hidden=64, seed=3)
    tmp = tempfile.mkdtemp()
    generate_data(t, _prompts(24, 64, seed=2), f"{tmp}/data", batch_size=8, max_new_tokens=12, progress=False)
    finals = {}
    for name, mesh in (("1", None), ("2x4", sharding.make_mesh(2, 4))):
        cfg = TrainConfig(kind="hsd", data_dir=f"{tmp}/data", out_dir=f"{tmp}/run_{name}", steps=3, batch_size=8,
                          window=24, unroll=2, ce_positions=4, learning_rate=1e-2, warmup_steps=1,
                          draft_vocab_size=0, save_every=2, eval_every=1000, holdout_fraction=0.2)
        final = train(cfg, target=t, mesh=mesh, progress=False, log=lambda *_: None)
        finals[name] = {k: final[k] for k in ("loss_first", "loss_last", "accept_by_depth")}
    report["train_run"] = finals


def check_smollm2(report):
    """SmolLM2-135M (9 heads, 3 KV heads) split over the model axis (1x3), real chat prompts, ar and
    hsd (the data axis: the tiny target's 2x4 and 8x1)."""
    from hsd_jax import generate, load_drafter, load_target, sharding
    from hsd_jax.prompts import load_suite

    t = load_target("smollm2-135m", max_cache_len=256)
    d = load_drafter("hsd", target=t, random_init=True, draft_vocab_size=4096)
    prompts = load_suite("mt_bench", 3)
    kw = dict(max_new_tokens=12, chat=True)
    ref = {"ar": _ids(generate(t, prompts, **kw)),
           "hsd": _ids(generate(t, prompts, method="hsd", drafter=d, **SPEC, **kw))}
    for data, model in ((1, 3),):
        mesh = sharding.make_mesh(data, model)
        report[f"smollm2_{data}x{model}"] = {
            "ar": _ids(generate(t, prompts, mesh=mesh, **kw)) == ref["ar"],
            "hsd": _ids(generate(t, prompts, method="hsd", drafter=d, mesh=mesh, **SPEC, **kw)) == ref["hsd"]}


def check_errors(report):
    """Bad meshes name the offending dimension."""
    from hsd_jax import generate, sharding
    from hsd_jax.config import ModelConfig
    from tests.helpers import tiny_target

    t = tiny_target(vocab=64, layers=1, heads=8, kv_heads=4, hidden=64, seed=2)
    cfg12 = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=1, num_heads=12,
                        num_kv_heads=4)
    report["errors"] = {
        "kv_heads": _error(lambda: generate(t, _prompts(8, 64), max_new_tokens=2, mesh=sharding.make_mesh(1, 8))),
        "heads": _error(lambda: sharding.check_mesh(cfg12, sharding.make_mesh(1, 8))),
        "batch": _error(lambda: generate(t, _prompts(6, 64), max_new_tokens=2, mesh=sharding.make_mesh(4, 2))),
        "too_many_devices": _error(lambda: sharding.make_mesh(4, 4)),
        "parse_bad": _error(lambda: sharding.parse_mesh("2by4")),
        "parse_zero": _error(lambda: sharding.parse_mesh("0x8")),
        "parse_ok": list(sharding.parse_mesh(" 2x4 ")),
    }


def main(checks):
    import time

    import jax

    report = {"devices": jax.device_count()}
    for check in checks:
        t0 = time.perf_counter()
        check(report)
        report[f"seconds_{check.__name__}"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


CHECKS = {"tiny": (check_generate, check_pallas, check_qwen3, check_placement, check_training, check_train_run, check_errors),
          "smollm2": (check_smollm2,)}


def start_child(which: str) -> subprocess.Popen:
    from tests.helpers import child_xla_flags

    env = dict(os.environ, XLA_FLAGS=child_xla_flags(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")   # files: no pipe to fill up
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), which], env=env, cwd=ROOT, stdout=out,
                            stderr=err, text=True)
    proc.outputs = (out, err)
    return proc


def child_report(proc: subprocess.Popen) -> dict:
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    for f in proc.outputs:
        f.seek(0)
    out, err = (f.read() for f in proc.outputs)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def children():
    """Both children start together: each spends most of its time compiling on one core."""
    procs = {which: start_child(which) for which in CHECKS}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def report(children):
    return child_report(children["tiny"])


def test_eight_fake_devices(report):
    assert report["devices"] == 8


@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_mesh_matches_single_device(report, mesh):
    assert report[f"generate_{mesh}"] == {"ar": True, "hsd": True}


def test_greedy_hsd_matches_ar(report):
    assert report["ref_hsd_matches_ar"]


def test_ngram_floor_on_a_mesh(report):
    assert report["ngram_2x4"] == {"single_matches_ar": True, "mesh_matches_single": True}


def test_eagle3_on_a_mesh(report):
    assert report["eagle3_2x4"] == {"single_matches_ar": True, "mesh_matches_single": True}


def test_pallas_attention_runs_per_shard(report):
    assert report["pallas_2x4"] == {"ar": True, "hsd": True, "shard_map": True}


def test_qwen3_with_pallas_attention_on_a_mesh(report):
    assert report["qwen3_2x4"] == {"hsd": True, "q_norm_replicated": True, "q_proj_split": True}


def test_weights_and_cache_are_sharded(report):
    p = report["placement"]
    assert p["q_proj"] == {"spec": [None, None, "model"], "n": 8, "shapes": [[2, 64, 16]]}
    assert p["o_proj"] == {"spec": [None, "model", None], "n": 8, "shapes": [[2, 16, 64]]}
    assert p["down_proj"]["shapes"] == [[2, 32, 64]]
    assert p["embedding"] == {"spec": ["model", None], "n": 8, "shapes": [[16, 64]]}
    assert p["lm_head"]["shapes"] == [[64, 16]]
    assert p["norm"] == {"spec": [None], "n": 8, "shapes": [[64]]}
    assert p["inject_w1"]["shapes"] == [[128, 32]]
    assert p["eagle3_q"] == {"spec": [None, "model"], "n": 8, "shapes": [[128, 16]]}
    assert p["eagle3_o"] == {"spec": ["model", None], "n": 8, "shapes": [[16, 64]]}
    assert p["cache_k"] == {"spec": [None, "data", "model", None, None], "n": 8, "shapes": [[2, 4, 2, 32, 8]]}
    assert p["cache_lengths"]["shapes"] == [[4]]
    assert p["values_kept"]


def test_sharded_training_step_matches(report):
    tr = report["training"]
    for mesh in ("2x4", "8x1"):
        assert tr[mesh]["loss"] == pytest.approx(tr["loss"], rel=1e-5, abs=1e-6)
        assert tr[mesh]["max_param_diff"] < 1e-5
    assert tr["2x4"]["q_spec"] == tr["2x4"]["adam_mu_spec"] == [None, None, "model"]


def test_sharded_train_run_matches(report):
    one, sharded = report["train_run"]["1"], report["train_run"]["2x4"]
    assert sharded["loss_first"] == pytest.approx(one["loss_first"], rel=1e-4)
    assert sharded["loss_last"] == pytest.approx(one["loss_last"], rel=1e-4)
    assert sharded["accept_by_depth"] == one["accept_by_depth"]


def test_bad_mesh_errors_name_the_dimension(report):
    e = report["errors"]
    assert "num_kv_heads=4" in e["kv_heads"] and "model axis 8" in e["kv_heads"]
    assert "num_heads=12" in e["heads"]
    assert "data axis 4" in e["batch"] and "batch size 6" in e["batch"]
    assert "needs 16 devices" in e["too_many_devices"]
    assert "DATAxMODEL" in e["parse_bad"] and ">= 1" in e["parse_zero"]
    assert e["parse_ok"] == [2, 4]


@pytest.mark.slow
def test_smollm2_on_1x3_matches_single_device(children):
    rep = child_report(children["smollm2"])
    assert rep["smollm2_1x3"] == {"ar": True, "hsd": True}


if __name__ == "__main__":
    main(CHECKS[sys.argv[1] if len(sys.argv) > 1 else "tiny"])
