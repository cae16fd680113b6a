"""Multi-host for real: two processes on this machine (4 fake CPU devices each, localhost coordinator,
gloo collectives) form one 2x4 mesh; they must give what one process with 8 devices gives, only
process 0 may write files, and a dead, missing or misconfigured process must end the run with a
clear error in bounded time.

This file is also the worker script (`python tests/test_multihost.py MODE ...`), because the device
count and the distributed runtime must be set before JAX starts.
"""
import contextlib
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = dict(tree_nodes=6, tree_depth=3, tree_top_k=2)
NEW = 12
HEARTBEAT_S, INIT_S = 5, 8


def _prompts(n, vocab=64, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(3, 14))).tolist() for _ in range(n)]


def _ignored(path: str) -> bool:
    """Python's bytecode cache and JAX's compilation cache are not outputs of a run."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return "__pycache__" in path or bool(cache) and path.startswith(cache)


def _record_writes(log: list) -> None:
    """Note every file or folder this process creates, changes or removes through Python."""
    def hook(event, args):
        if event == "open" and args[0] is not None and not isinstance(args[0], int):
            mode, flags = args[1] or "", args[2] or 0
            written = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if written and not _ignored(str(args[0])):
                log.append(str(args[0]))
        elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree",
                       "shutil.copyfile", "shutil.move", "os.symlink", "os.truncate"):
            if not _ignored(str(args[0])):
                log.append(f"{event} {args[0]}")

    sys.addaudithook(hook)


def _emit(result: dict) -> None:
    """One stdout write per result line: gloo's C++ logging shares the descriptor, and with
    PYTHONUNBUFFERED a print's text and its newline are two writes it can land between."""
    os.write(1, (json.dumps(result) + "\n").encode())


def _result(out: str) -> dict | None:
    """The last JSON object of a worker's stdout, wherever gloo's log lines fell around it."""
    found = None
    for line in out.splitlines():
        start = line.find('{"')
        if start >= 0:
            with contextlib.suppress(json.JSONDecodeError):
                found = json.JSONDecoder().raw_decode(line[start:])[0]
    return found


def work_run(model_dir: str, out: str) -> dict:
    """The same run in every layout: ar and hsd at T=0 and T=1, self-distilled data, two training
    steps then a resumed third, a bench JSON and a tuned file, all on a 2x4 mesh."""
    import hashlib

    import numpy as np

    from hsd_jax import cpu_kernels, distributed, generate, load_drafter, load_target, sharding
    from hsd_jax.bench import make_runner, run_bench, save_result
    from hsd_jax.train.data import generate_data, shard_paths
    from hsd_jax.train.trainer import TrainConfig, train
    from hsd_jax.tuning import save_tuned

    writes: list[str] = []
    _record_writes(writes)
    mesh = sharding.make_mesh(2, 4)
    t = load_target(model_dir, mesh=mesh, tokenizer=False, max_cache_len=128)
    d = load_drafter("hsd", target=t, random_init=True)
    prompts = _prompts(8)
    ids = lambda res: [r.token_ids for r in res]
    rep = {"process_count": __import__("jax").process_count(), "devices": __import__("jax").device_count()}
    for temp in (0.0, 1.0):
        rep[f"ar_T{temp:g}"] = ids(generate(t, prompts, max_new_tokens=NEW, temperature=temp, seed=3, mesh=mesh))
        rep[f"hsd_T{temp:g}"] = ids(generate(t, prompts, max_new_tokens=NEW, temperature=temp, seed=3, mesh=mesh,
                                             method="hsd", drafter=d, **SPEC))
    generate_data(t, _prompts(16, seed=2), f"{out}/data", batch_size=8, max_new_tokens=NEW, progress=False, mesh=mesh)
    rep["data_sha"] = [hashlib.sha1(open(p, "rb").read()).hexdigest() for p in shard_paths(f"{out}/data")]
    cfg = dict(kind="hsd", data_dir=f"{out}/data", out_dir=f"{out}/train", batch_size=8, window=24, unroll=2,
               ce_positions=4, learning_rate=1e-2, warmup_steps=1, draft_vocab_size=48, save_every=1,
               eval_every=1000, holdout_fraction=0.2, eval_untrained=False)
    first = train(TrainConfig(steps=2, **cfg), target=t, mesh=mesh, progress=False, log=lambda *_: None)
    resumed = train(TrainConfig(steps=3, **cfg), target=t, mesh=mesh, progress=False, log=lambda *_: None)
    rep["train"] = {k: first[k] for k in ("loss_first", "loss_last", "accept_by_depth")}
    rep["train_resumed"] = {k: resumed[k] for k in ("step", "loss_first", "accept_by_depth")}
    trained = load_drafter("hsd", f"{out}/train/drafter", target=t)
    rep["trained_param_sums"] = [float(np.asarray(x, np.float64).sum()) for x in
                                 __import__("jax").tree.leaves(trained.params)]
    rep["trained_d2t"] = np.asarray(trained.d2t).tolist()
    runners = {name: make_runner(t, name, d if name == "hsd" else None, options=SPEC, max_new_tokens=NEW, mesh=mesh)
               for name in ("ar", "hsd")}
    bench = run_bench(runners, prompts, batch_size=8, progress=False)
    rep["bench_identical"] = bench["hsd"]["identical_to_ar"]
    save_result({"methods": bench}, f"{out}/bench.json")
    save_tuned({"tree": SPEC, "method": "hsd"}, t, d, folder=f"{out}/tuned")
    rep["cpu_kernel"] = cpu_kernels.enabled()
    distributed.barrier("done")
    rep["writes"] = sorted(set(writes))
    return rep


def work_fault(kind: str) -> dict:
    """A cross-process collective in a loop; process 1 kills itself after the first iteration."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hsd_jax import sharding

    mesh = sharding.make_mesh(2, 4)
    x = sharding.put(np.arange(64.0).reshape(8, 8), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        "data", "model")))
    f = jax.jit(lambda a: jnp.sum(a * a))
    out = [float(f(x))]
    _emit({"first": out[0]})
    if kind == "kill" and jax.process_index() == 1:
        os.kill(os.getpid(), 9)
    for _ in range(200):
        time.sleep(0.1)
        out.append(float(f(x)))
    return {"iterations": len(out)}


def worker(mode: str, *args) -> None:
    from hsd_jax.distributed import exit_on_peer_failure, maybe_initialize_distributed

    with exit_on_peer_failure():
        try:
            maybe_initialize_distributed()
        except Exception as e:   # the start-up errors under test: print them as the CLI does
            _emit({"error": f"{type(e).__name__}: {e}"})
            sys.exit(3)
        rep = work_run(*args) if mode == "run" else work_fault(*args)
    _emit(rep)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(mode: str, args, *, devices: int, process_id: int | None = None, num_processes: int | None = None,
          port: int | None = None, env_extra: dict | None = None) -> subprocess.Popen:
    from tests.helpers import child_xla_flags

    keep = ("HSD_JAX_CACHE",)   # the suite's private cache, not the user's
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSD_") or k in keep}
    env.update(XLA_FLAGS=child_xla_flags(devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               HSD_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S), HSD_INIT_TIMEOUT_S=str(INIT_S))
    if process_id is not None:
        env.update(HSD_COORDINATOR=f"127.0.0.1:{port}", HSD_NUM_PROCESSES=str(num_processes),
                   HSD_PROCESS_ID=str(process_id))
    env.update(env_extra or {})
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), mode, *args], env=env, cwd=ROOT,
                            stdout=out, stderr=err, text=True)
    proc.outputs, proc.started = (out, err), time.monotonic()
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, dict | None, str, float]:
    """(return code, last JSON line of stdout or None, stderr, seconds from start to exit)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None, None, "timed out", timeout
    seconds = time.monotonic() - proc.started
    for f in proc.outputs:
        f.seek(0)
    out, err = (f.read() for f in proc.outputs)
    return proc.returncode, _result(out), err, seconds


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One single-process 8-device run and one two-process 2x(4 devices) run of `work_run`, side by side;
    the two processes on a user cache of their own, empty (no CPU kernel built: they must build none)."""
    from tests.helpers import save_hf_dir, tiny_target

    base = tmp_path_factory.mktemp("multihost")
    model_dir = str(base / "model")
    save_hf_dir(tiny_target(vocab=64, layers=2, heads=8, kv_heads=8, hidden=64, seed=1), model_dir)
    port = free_port()
    procs = {"single": start("run", [model_dir, str(base / "single")], devices=8)}
    for i in (0, 1):
        procs[f"p{i}"] = start("run", [model_dir, str(base / "multi")], devices=4, process_id=i, num_processes=2,
                               port=port, env_extra={"HSD_JAX_CACHE": str(base / "multi-cache")})
    out = {}
    for name, proc in procs.items():
        rc, rep, err, _ = finish(proc, timeout=600)
        assert rc == 0, f"{name}: {err[-4000:]}"
        out[name] = rep
    out["dirs"] = {"single": str(base / "single"), "multi": str(base / "multi"),
                   "multi_cache": str(base / "multi-cache")}
    return out


def test_a_result_line_is_read_whatever_gloo_logs_around_it():
    """CI once failed on '{"first": 85344.0}[Gloo] Rank 1 is connected ...' (one line)."""
    out = '[Gloo] Rank 0 is connected\n{"first": 85344.0}[Gloo] Rank 1 is connected to 1 peer ranks\n'
    assert _result(out) == {"first": 85344.0}
    assert _result('{"a": 1}\n[Gloo] x {"b": 2}\n') == {"b": 2}
    assert _result("[Gloo] nothing here\n") is None


def test_one_mesh_across_two_processes(runs):
    assert runs["p0"]["process_count"] == 2 and runs["p0"]["devices"] == 8
    assert runs["single"]["process_count"] == 1 and runs["single"]["devices"] == 8


@pytest.mark.parametrize("key", ["ar_T0", "hsd_T0", "ar_T1", "hsd_T1"])
def test_tokens_equal_the_single_process_run(runs, key):
    assert runs["p0"][key] == runs["p1"][key] == runs["single"][key]


def test_greedy_hsd_matches_ar_and_sampling_varies(runs):
    single = runs["single"]
    assert single["hsd_T0"] == single["ar_T0"]
    assert single["ar_T1"] != single["ar_T0"]


def test_training_equals_the_single_process_run(runs):
    one, p0, p1 = runs["single"], runs["p0"], runs["p1"]
    assert p0["data_sha"] == one["data_sha"] and len(one["data_sha"]) == 2
    for key in ("loss_first", "loss_last"):
        assert p0["train"][key] == pytest.approx(one["train"][key], rel=1e-4)
    assert p0["train"]["accept_by_depth"] == one["train"]["accept_by_depth"] == p1["train"]["accept_by_depth"]
    assert p0["train_resumed"]["step"] == one["train_resumed"]["step"] == 3
    assert p0["train_resumed"]["loss_first"] == pytest.approx(one["train_resumed"]["loss_first"], rel=1e-4)
    assert p0["trained_param_sums"] == pytest.approx(one["trained_param_sums"], rel=1e-4, abs=1e-3)
    assert p0["trained_d2t"] == one["trained_d2t"] and len(one["trained_d2t"]) == 48
    assert p0["bench_identical"] is True and one["bench_identical"] is True


def test_only_process_0_writes(runs):
    multi = runs["dirs"]["multi"]
    assert runs["p1"]["writes"] == []
    p0 = runs["p0"]["writes"]
    for part in ("data/shard_00000.npz", "train/draft_vocab.npz", "train/drafter/drafter.json",
                 "train/drafter/d2t.npy", "train/metrics.json", "bench.json", "tuned/"):
        assert any(part in w for w in p0), part
    files = [os.path.relpath(p, multi) for p in glob.glob(f"{multi}/**", recursive=True)]
    assert any(f.startswith("train/checkpoints/3") for f in files)
    assert any(f.startswith("train/drafter/params") for f in files)
    assert not [f for f in files if "process_1" in f]   # Orbax's per-process files: none from process 1
    assert json.load(open(f"{multi}/bench.json"))["methods"]["hsd"]["identical_to_ar"] is True


def test_a_multi_process_run_neither_builds_nor_uses_the_cpu_kernels(runs):
    assert runs["p0"]["cpu_kernel"] is False and runs["p1"]["cpu_kernel"] is False
    assert not os.path.exists(os.path.join(runs["dirs"]["multi_cache"], "cpu_kernels"))   # nothing built, nor locked


def test_a_killed_process_ends_the_other_with_a_clear_error():
    port = free_port()
    procs = [start("fault", ["kill"], devices=4, process_id=i, num_processes=2, port=port) for i in (0, 1)]
    rc0, _, err0, seconds = finish(procs[0], timeout=120)
    rc1, _, _, _ = finish(procs[1], timeout=30)
    assert rc1 == -9
    assert rc0 not in (0, None), err0[-2000:]
    assert "process 0 of 2 stopped" in err0 or "another task died" in err0, err0[-2000:]
    assert seconds < 60 + HEARTBEAT_S


BAD_STARTS = {"too_few_started": ["only 1 of the 2 other processes"] * 2,
              "counts_differ": ["every process needs the same count"] * 2,
              "no_coordinator": ["could not reach the coordinator at 127.0.0.1"]}


@pytest.fixture(scope="module")
def bad_starts():
    """Every bad start's processes at once, each case on its own port: they spend their time
    waiting for the start-up timeout, so the cases wait together."""
    with contextlib.ExitStack() as stack:   # the ports stay bound until all are chosen: all differ
        socks = [stack.enter_context(socket.socket()) for _ in BAD_STARTS]
        for sk in socks:
            sk.bind(("127.0.0.1", 0))
        ports = dict(zip(BAD_STARTS, (sk.getsockname()[1] for sk in socks)))
    layout = {"too_few_started": ((0, 3), (1, 3)), "counts_differ": ((0, 2), (1, 3)), "no_coordinator": ((1, 2),)}
    procs = {case: [start("fault", ["none"], devices=4, process_id=i, num_processes=n, port=ports[case])
                    for i, n in layout[case]] for case in BAD_STARTS}
    return {case: [finish(p, timeout=60) for p in group] for case, group in procs.items()}


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_bad_starts_fail_clearly(bad_starts, case):
    for (rc, rep, err, seconds), text in zip(bad_starts[case], BAD_STARTS[case]):
        assert rc == 3, err[-2000:]
        assert rep["error"].startswith("DistributedError") and text in rep["error"], rep
        assert seconds < INIT_S + 20


@pytest.mark.parametrize("env,text", [
    ({"HSD_COORDINATOR": "127.0.0.1:1234", "HSD_NUM_PROCESSES": "2"}, "HSD_PROCESS_ID is not"),
    ({"HSD_COORDINATOR": "127.0.0.1:1234", "HSD_NUM_PROCESSES": "2", "HSD_PROCESS_ID": "2"}, "out of range"),
    ({"HSD_COORDINATOR": "localhost", "HSD_NUM_PROCESSES": "2", "HSD_PROCESS_ID": "0"}, "host:port"),
    ({"HSD_COORDINATOR": "h:1", "HSD_NUM_PROCESSES": "two", "HSD_PROCESS_ID": "0"}, "whole number"),
    ({"HSD_COORDINATOR": "h:1", "HSD_NUM_PROCESSES": "0", "HSD_PROCESS_ID": "0"}, ">= 1"),
    ({"HSD_DISTRIBUTED": "auto", "HSD_HEARTBEAT_TIMEOUT_S": "0"}, "HSD_HEARTBEAT_TIMEOUT_S must be >= 1"),
])
def test_bad_environment_is_refused_before_jax_starts(monkeypatch, env, text):
    from hsd_jax import distributed

    for k in [k for k in os.environ if k.startswith("HSD_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(distributed.DistributedError, match=text):
        distributed.maybe_initialize_distributed()


def test_single_process_helpers_are_no_ops():
    from hsd_jax import distributed

    assert distributed.agree({"a": [1, 2]}) == {"a": [1, 2]}
    assert distributed.is_primary() and not distributed.multi_process()
    distributed.barrier("noop")


if __name__ == "__main__":
    worker(*sys.argv[1:])
