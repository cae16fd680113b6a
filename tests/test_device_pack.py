"""The accelerator run pack (benchmarks/device): its dry run on the CPU, every part end to end,
so the script cannot rot between GPU leases; and the staging of the model over several calls."""
import importlib.util
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.helpers import tiny_smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "device" / "run.sh"


def _stage_module():
    spec = importlib.util.spec_from_file_location("device_stage", ROOT / "benchmarks" / "device" / "stage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dry_run(parts: str, out, work, model, *flags) -> subprocess.Popen:
    cmd = ["bash", str(RUN), "--dry-run", "--parts", parts, "--out", str(out), "--work", str(work), "--budget-s",
           "1500", "--model", model, *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """Every part on a tiny random GGUF with SmolLM2's tokenizer (the staged-model path a lease uses):
    the pack's code end to end at a fraction of SmolLM2's compile and run time. Six parts run
    `--in-process` (one JAX start-up and model load), the kernel part at the same time through the
    per-part process driver a lease uses."""
    out, work = tmp_path_factory.mktemp("pack_out"), tmp_path_factory.mktemp("pack_work")
    model = tiny_smollm2_gguf(tmp_path_factory.mktemp("pack_model") / "model.gguf")
    kernel_out = tmp_path_factory.mktemp("pack_kernel_out")
    procs = {"main": _dry_run("smoke,train,scale,exact,bench,tune", out, work, model, "--in-process"),
             "kernel": _dry_run("kernel", kernel_out, tmp_path_factory.mktemp("pack_kernel_work"), model)}
    runs = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1700)
        runs[name] = (proc.returncode, stdout, stderr)
    return runs, out, kernel_out


def _results(out) -> dict:
    return json.loads((out / "results.json").read_text())["parts"]


def test_dry_run_every_part_succeeds_and_returns_at_most_eight_flat_files(dry_run):
    runs, out, kernel_out = dry_run
    for name, folder in (("main", out), ("kernel", kernel_out)):
        rc, _, stderr = runs[name]
        log = (folder / "log.txt").read_text() if (folder / "log.txt").exists() else stderr
        assert rc == 0, log[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert all((out / f).is_file() for f in files), files          # nothing nested: the device returns files
    assert len(files) <= 8, files
    assert {"summary.md", "results.json", "log.txt", "bench.png", "tuned.json", "drafters.tar"} <= set(files)
    statuses = {name: p["status"] for o in (out, kernel_out) for name, p in _results(o).items()}
    assert statuses == dict.fromkeys(("smoke", "train", "scale", "exact", "bench", "tune", "kernel"), "ok")
    log = (out / "log.txt").read_text()     # in one process, each part's output still lands under its header
    assert log.index("===== part train") < log.index("train data:") < log.index("===== part bench")


def test_dry_run_results_are_real_measurements(dry_run):
    _, out, kernel_out = dry_run
    parts = {k: v["result"] for o in (out, kernel_out) for k, v in _results(o).items()}
    smoke = parts["smoke"]
    assert all(row["identical_to_ar"] for k, row in smoke["float32"].items() if k != "ar")   # bf16: on the device only
    train = parts["train"]
    assert train["data"]["response_tokens"] > 0 and train["data"]["sequences"] >= 8
    for kind in ("hsd", "eagle", "eagle3"):
        run = train["runs"][kind]
        assert run["step"] >= 1 and len(run["accept_by_depth"]) == 2 and run["steps_per_s"] > 0
    for key in ("batch8", "batch1"):
        methods = parts["bench"][key]["methods"]
        assert "ar" in methods and len(methods) >= 2
        assert all(m["identical_to_ar"] for m in methods.values())      # float32 on the CPU: exact
        assert all(m["prefix_match"]["min"] == 1.0 for m in methods.values())
    assert parts["bench"]["drafters"]["hsd"].endswith("run_hsd/drafter")  # the drafters trained by this run
    identity = parts["bench"]["identity_f32"]
    assert identity.pop("prompts") == 2 and identity and all(identity.values())
    scale = parts["scale"]["targets"]["tiny-shape"]        # random bf16 target: costs, and the model's speedups
    assert scale["ar_ms_per_token"] > 0 and set(scale["verify_ms"]) == {"1", "2", "4"}   # the sweep + the tree's width
    for kind in ("hsd", "eagle", "eagle3"):
        k = scale["kinds"][kind]
        assert k["round_ms"] > 0 and k["drafter_steps_per_round"] >= 1 and k["speedup_at_smollm2_tau"] > 0
    exact = parts["exact"]          # float32 on the CPU: identical with and without exact
    assert exact["rows"] == 8 and exact["ar_exact_equals_ar"]["min"] == 1.0
    assert all(exact[mode]["hsd"]["identical_to_ar"] for mode in ("plain", "exact"))
    diffs = exact["layer_diffs"]
    assert set(diffs) == {"plain/chain", "plain/tree", "exact/chain", "exact/tree"}
    assert all(len(d["max_abs_diff_by_layer"]) == 2 and d["argmax_equal"] for d in diffs.values())
    assert diffs["exact/chain"]["rows"] == [8, 8] and diffs["plain/tree"]["rows"] == [1, 5]
    # one row width and positional attention: a token computes bitwise alike in a step and in a verify
    assert diffs["exact/chain"]["max_abs_diff_by_layer"] == diffs["exact/tree"]["max_abs_diff_by_layer"] == [0.0, 0.0]
    tuned = json.loads((out / "tuned.json").read_text())
    assert set(tuned["tree"]) == {"tree_nodes", "tree_depth", "tree_top_k"} and tuned["verify_cost_ms"]
    errors = {e["dtype"]: e["max_abs_diff"] for e in parts["kernel"]["errors"]}
    assert errors["float32"] < 1e-5 and errors["bfloat16"] < 5e-2
    assert all("pallas_ms" in row and row["xla_ms"] > 0 for row in parts["kernel"]["timing"])


def test_dry_run_drafters_load_from_the_returned_tar(dry_run, tmp_path):
    _, out, _ = dry_run
    with tarfile.open(out / "drafters.tar") as tf:
        tf.extractall(tmp_path, filter="data")
    card = (tmp_path / "hsd" / "MODEL_CARD.md").read_text()
    assert "Held-out top-1 acceptance" in card and "no evaluation prompts" in card
    meta = json.loads((tmp_path / "hsd" / "drafter.json").read_text())
    assert meta["kind"] == "hsd" and meta["config"]["draft_vocab_size"] == 256
    assert {json.loads((tmp_path / k / "drafter.json").read_text())["kind"] for k in ("eagle", "eagle3")} == {
        "eagle", "eagle3"}


def test_bad_parts_is_one_clear_error(tmp_path):
    proc = subprocess.run(["bash", str(RUN), "--dry-run", "--parts", "train,warp", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--parts must list some of smoke, train, scale, exact, bench, tune, kernel" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_staged_parts_are_joined_and_checked(tmp_path, monkeypatch):
    stage = _stage_module()
    blob = os.urandom(10_000)
    local, remote = tmp_path / "stage", tmp_path / "remote"
    local.mkdir()
    monkeypatch.setattr(stage, "STAGE", str(local))
    monkeypatch.setattr(stage, "REMOTE", str(remote))
    (tmp_path / "m.gguf").write_bytes(blob)
    manifest = {"file": "m.gguf", "bytes": len(blob), "sha256": stage.sha256(str(tmp_path / "m.gguf")), "parts": 3}
    (local / "manifest.json").write_text(json.dumps(manifest))
    cuts = [blob[:4000], blob[4000:8000], blob[8000:]]
    for i, cut in enumerate(cuts):  # one part arrives per call; earlier ones were removed from the tree
        for old in local.glob("gguf.part*"):
            old.unlink()
        (local / f"gguf.part{i + 1}").write_bytes(cut)
        stage.collect(None)
        assert (remote / "model.gguf").exists() == (i == 2)
    assert (remote / "model.gguf").read_bytes() == blob

    (remote / "model.gguf").unlink()
    (remote / "gguf.part2").write_bytes(b"x" * 4000)   # a corrupted part is refused, not used
    (local / "gguf.part3").unlink()
    with pytest.raises(SystemExit, match="SHA-256"):
        stage.collect(None)
    assert not (remote / "model.gguf").exists()
