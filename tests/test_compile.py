"""`hsd compile`: generate's programs (per method a prefill and a decode loop) and the drafter training
steps compile for a TPU (deviceless, libtpu) and lower for CUDA on this CPU machine, each decode loop
with the Pallas tree-attention kernel in it (Mosaic on TPU, Triton on CUDA).

Cost (measured 2026-12-03 on the shared 2-core CPU before the prefill/decode split, other jobs
running; the module took 145 s after it): a TPU compile of the tiny model's loops takes 4-24 s each (ar 4, lookup 8, ngram 9, sd 13, eagle/eagle3/hsd 23-24), a training
step ~30 s; SmolLM2's speculative loops 30-80 s. So the suite compiles a representative set for TPU,
all in one child process (one JAX and libtpu start; ~200 s of that CPU): every method once, bf16 at
batch 1 (ar, hsd, eagle3, lookup) and f32 at batch 4 (sd, eagle, ngram); hsd's training step; a 1x4
model-axis mesh (lookup); SmolLM2 on v5e (lookup: the kernel at its 9/3 heads) and on v3 (ar: v3's
Mosaic refuses bf16 matmuls, which the kernel now widens). CUDA lowering (~1-5 s a program): the same
split of methods and every kind's training step. The full matrix (every method x bf16/f32 x batch
1/4, SmolLM2, every training step) ran by hand with `hsd compile` (BENCHMARKS.md, "Compiled for a TPU
without one")."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import run_cli, save_hf_dir, tiny_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
ALL_METHODS = ("ar", "sd", "eagle", "eagle3", "hsd", "ngram", "lookup")
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
TINY_KV4 = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4)
TRAIN_SMALL = dict(batch_size=2, window=32, unroll=2, ce_positions=8)

# One child process builds all of these (one JAX start, one libtpu start).
TPU_RUNS = [
    dict(config=TINY, tpu="v5e:2x2", method_names=["ar", "hsd", "eagle3", "lookup"], dtype="bfloat16", batch=1,
         train=["hsd"], train_options=TRAIN_SMALL),
    dict(config=TINY, tpu="v5e:2x2", method_names=["sd", "eagle", "ngram"], dtype="float32", batch=4),
    dict(config=TINY_KV4, tpu="v5e:2x2", method_names=["lookup"], dtype="bfloat16", batch=1, mesh=[1, 4]),
    dict(model="smollm2-135m", tpu="v5e:2x2", method_names=["lookup"], dtype="bfloat16", batch=1),
    dict(model="smollm2-135m", tpu="v3:2x2", method_names=["ar"], dtype="bfloat16", batch=1),
]


def _run_all(runs: list[dict]) -> list[dict]:
    """Child process: compile_all for each run; one JSON report per run."""
    from hsd_jax import compile as hc
    from hsd_jax.config import ModelConfig

    reports = []
    for run in runs:
        run = dict(run)
        if "config" in run:
            run["config"] = ModelConfig(**run["config"])
        if "mesh" in run:
            run["mesh"] = tuple(run["mesh"])
        reports.append(hc.compile_all(**run))
    return reports


@pytest.fixture(scope="module")
def tpu_reports():
    if not HAS_LIBTPU:
        pytest.skip("libtpu is not installed (pip install -e '.[tpu-compile]'): no TPU compiler here")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, __file__, json.dumps(TPU_RUNS)], capture_output=True, text=True,
                          env=env, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(report, platform, kernel):
    assert report["platform"] == platform
    failed = [(p["name"], p["error"]) for p in report["programs"] if not p["ok"]]
    assert not failed and report["ok"], failed
    for p in report["programs"]:
        # every decode loop runs the Pallas tree attention; prefill (causal attention over the
        # prompt) need not
        assert p["kernels_expected"] == ("/decode/" in p["name"]), p
        if p["kernels_expected"]:
            assert p["kernels"][kernel] >= 1, p
        elif p["name"].startswith("train-"):   # reference attention (no grad through pallas_call)
            assert p["kernels"][kernel] == 0, p


def test_tpu_every_method_and_training_compiles_with_mosaic(tpu_reports):
    tiny = tpu_reports[:2]
    names = {p["name"].split("/")[0] for r in tiny for p in r["programs"]}
    assert names == set(ALL_METHODS) | {"train-hsd"}
    for report in tiny:
        _check(report, "tpu", "mosaic")
        assert report["device_kind"] == "TPU v5 lite"
        for p in report["programs"]:
            mem, cost = p["memory"], p["cost"]
            assert mem["argument"] > 0 and mem["fits"] and 15 << 30 < mem["hbm"] < 17 << 30   # v5e: 16 GiB
            assert cost["flops"] > 0 and cost["bytes_accessed"] > 0
    assert {r["dtype"] for r in tiny} == {"bfloat16", "float32"} and {r["batch"] for r in tiny} == {1, 4}


def test_tpu_model_axis_mesh_compiles(tpu_reports):
    report = tpu_reports[2]
    _check(report, "tpu", "mosaic")
    assert report["mesh"] == "1x4"
    assert [p["name"] for p in report["programs"]] == ["lookup/prefill64/bf16/b1/mesh1x4", "lookup/decode/bf16/b1/mesh1x4"]


def test_tpu_smollm2_compiles_on_v5e_and_v3(tpu_reports):
    v5e, v3 = tpu_reports[3:]
    for report, kind in ((v5e, "TPU v5 lite"), (v3, "TPU v3")):
        _check(report, "tpu", "mosaic")
        assert report["device_kind"] == kind
    # SmolLM2's 135M bf16 weights (~270 MB) are the arguments: the compiler saw the real shapes
    assert 250e6 < v5e["programs"][0]["memory"]["argument"] < 400e6


@pytest.fixture(scope="module")
def tiny_config():
    from hsd_jax.config import ModelConfig

    return ModelConfig(**TINY)


@pytest.mark.parametrize("run", [0, 1])
def test_cuda_every_method_and_kind_lowers_with_triton(tiny_config, run):
    """The TPU runs' split of methods, dtypes and batches, and every kind's training step."""
    from hsd_jax import compile as hc

    spec = TPU_RUNS[run]
    train = list(hc.TRAIN_KINDS[:2] if run == 0 else hc.TRAIN_KINDS[2:])
    report = hc.compile_all(cuda=True, config=tiny_config, dtype=spec["dtype"], batch=spec["batch"],
                            method_names=spec["method_names"], train=train, train_options=TRAIN_SMALL)
    _check(report, "cuda", "triton")
    parts = [p["name"].split("/") for p in report["programs"]]
    names = [n[0] if n[0].startswith("train-") else f"{n[0]}/{n[1]}" for n in parts]
    assert names == [f"{m}/{part}" for m in spec["method_names"] for part in ("prefill64", "decode")] + [
        f"train-{k}" for k in train]


def test_cli_compile_reads_only_the_config_and_reports_json(tmp_path):
    save_hf_dir(tiny_target(), tmp_path / "tiny")
    r = run_cli("compile", "--cuda", "--model", tmp_path / "tiny", "--methods", "ar,lookup", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert [p["name"] for p in report["programs"]] == [f"{m}/{part}/bf16/b1" for m in ("ar", "lookup")
                                                       for part in ("prefill64", "decode")]
    _check(report, "cuda", "triton")


def test_shape_presets_have_the_published_parameter_counts():
    """`--model llama-3.2-1b-shape` / `llama-3.1-8b-shape` need no files: their abstract params count
    what the releases publish (1,235,814,400 and 8,030,261,248), so the compiler sees their real shapes."""
    import jax
    import numpy as np

    from hsd_jax import compile as hc

    for name, count in (("llama-3.2-1b-shape", 1_235_814_400), ("llama-3.1-8b-shape", 8_030_261_248)):
        cfg, _ = hc.model_config(name, "bfloat16", "tpu")
        params = hc.abstract_target(cfg, name).params
        assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) == count
        assert cfg.attention_impl == "pallas_tpu" and cfg.dtype == "bfloat16"


@pytest.mark.parametrize("args,message", [
    (["--cuda", "--methods", "medusa"], "unknown methods"),
    (["--cuda", "--mesh", "1x2"], "--mesh is for --tpu"),
    (["--cuda", "--methods", "none"], "nothing to compile"),
    (["--cuda", "--methods", "none", "--train", "bogus"], "--train kinds are"),
    (["--cuda", "--model", "no-such-model"], "unknown model"),
])
def test_cli_compile_bad_input_exits_2_with_one_line(args, message):
    r = run_cli("compile", *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr


if __name__ == "__main__":
    print(json.dumps(_run_all(json.loads(sys.argv[1]))))
