"""Start fast, compile once: one decode-loop compile per method whatever the prompt lengths and
`max_new_tokens`, the persistent compilation cache shared by processes, the dequantized-weights
cache (rebuilt when corrupt) and `warmup`."""
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types

import jax
import numpy as np
import pytest

from hsd_jax import api, compilation, cpu_kernels, kernel_build
from hsd_jax.api import generate, load_drafter
from hsd_jax.loading import weights_cache
from tests.helpers import run_cli, tiny_smollm2_gguf, tiny_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiles():
    """Names of the jitted functions XLA compiles (or fetches from the persistent cache) inside."""
    from jax._src import monitoring

    names = []

    def listener(event, duration, **kw):
        if event == BACKEND_COMPILE:
            names.append(str(kw.get("fun_name")).removeprefix("jit(").removesuffix(")"))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        monitoring.unregister_event_duration_listener(listener)


def test_the_decode_loop_compiles_once_per_method_for_any_prompt_length_and_bound():
    t = tiny_target(vocab=64, hidden=32, tie_word_embeddings=True, max_cache_len=96)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 5, 8, 11, 14, 17, 23, 30)]
    # hsd with prompt-lookup nodes: its drafter's init and the lookup both read the prompt
    runs = {"ar": {}, "hsd": dict(drafter=load_drafter("hsd", target=t, random_init=True, seed=1), lookup_slots=2,
                                  tree_nodes=4, tree_depth=3, tree_top_k=2)}
    api._COMPILED.clear()
    tokens = {}
    with compiles() as names:
        for method, kw in runs.items():
            for n in (5, 12, 20):
                for p in prompts:
                    r = generate(t, [p], max_new_tokens=n, method=method, **kw)[0]
                    assert r.stats["new_tokens"] == n   # no EOS in a tiny model: the bound is honoured
                    tokens[method, n, len(p)] = r.token_ids
    buckets = {api.prompt_bucket_length(len(p)) for p in prompts}
    assert buckets == {16, 32}
    assert names.count("ar_decode") == 1 and names.count("spec_decode") == 1
    assert names.count("ar_prefill") == names.count("spec_prefill") == len(buckets)
    for (method, n, length), ids in tokens.items():
        assert ids == tokens["ar", n, length], (method, n, length)     # greedy: every method is ar
        assert ids[:5] == tokens[method, 5, length]                    # a longer bound extends a shorter one


def _build_running(monkeypatch, enabled):
    """Make this process look as if its kernel build were still running until `enabled()` (the
    wait) is first called; `enabled` decides what that wait returns."""
    state = {"waits": []}
    monkeypatch.setattr(cpu_kernels, "building", lambda: not state["waits"])

    def wait():
        state["waits"].append(len(api._LOWERED))   # programs lowered ahead of the wait
        return enabled()

    monkeypatch.setattr(cpu_kernels, "enabled", wait)
    return state


def test_a_first_process_lowers_its_programs_while_the_kernel_library_builds(monkeypatch):
    """While the CPU kernel library still builds, `generate` packs the weights and lowers the prefill
    and the decode loop (its cache argument shaped from the lowered prefill) before it waits for the
    build; each program then compiles once, from those lowerings, and runs on the kernels."""
    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels are not available")
    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True, seed=5, max_cache_len=160)  # shapes no other test runs
    prompt = [[3, 9, 27, 4, 11, 50]]
    drafter = load_drafter("hsd", target=t, random_init=True, seed=2)
    spec = dict(method="hsd", drafter=drafter, tree_nodes=4, tree_depth=2, tree_top_k=2)
    state = _build_running(monkeypatch, cpu_kernels.enabled)
    with compiles() as names:
        got = generate(t, prompt, max_new_tokens=10, **spec)[0]
    assert state["waits"][0] == 1 and api._LOWERED == {}     # at the wait: the prefill's lowering taken, the loop's next
    assert names == ["spec_prefill", "spec_decode"]
    assert "packed_kernels" in api.serving_params(t)
    monkeypatch.setenv(kernel_build.ENV, "0")                     # XLA's dots: the same tokens
    assert generate(t, prompt, max_new_tokens=10, **spec)[0].token_ids == got.token_ids


def test_programs_lowered_for_a_kernel_build_that_then_fails_are_made_again_without(monkeypatch):
    """A build that fails after the programs were lowered for it: `generate` and `warmup` make them
    again on XLA's dots and answer as without the kernels (no error, nothing left lowered)."""
    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True, seed=6, max_cache_len=176)
    prompt = [[7, 1, 33, 2, 19]]
    _build_running(monkeypatch, lambda: False)
    monkeypatch.setattr(cpu_kernels, "_registered", lambda: False)
    got = generate(t, prompt, max_new_tokens=8)[0]
    assert api._LOWERED == {} and "packed_kernels" not in api.serving_params(t)
    _build_running(monkeypatch, lambda: False)
    assert api.warmup(t, max_prompt_len=16, progress=False)["programs"] == 2
    monkeypatch.setenv(kernel_build.ENV, "0")
    assert generate(t, prompt, max_new_tokens=8)[0].token_ids == got.token_ids


def test_programs_jitted_outside_generate_wait_for_the_kernel_build(monkeypatch):
    """`hsd tune`'s verify curve (jitted outside `generate`, as the benchmarks are) waits for a build
    still running before it runs: it found no FFI handler for the kernels' calls on a first process.
    A build that fails leaves it on XLA's dots."""
    from hsd_jax import tune

    t = tiny_target(vocab=64, hidden=64, tie_word_embeddings=True, seed=8, max_cache_len=64)
    for works in (cpu_kernels.enabled, lambda: False):
        state = _build_running(monkeypatch, works)
        assert "packed_kernels" in api.serving_params(t) or not cpu_kernels.wanted()   # not waiting: packed for the build
        assert state["waits"] == []
        ms = tune.verify_cost_curve(t, sizes=(1, 2), context=8, repeats=1)
        assert state["waits"] and sorted(ms) == [1, 2] and all(v > 0 for v in ms.values())
        assert ("packed_kernels" in api.serving_params(t, ready=True)) == bool(works())


def test_warmup_compiles_every_bucket_and_the_loop_ahead_of_generate():
    t = tiny_target(vocab=64, hidden=32, max_cache_len=128)
    api._COMPILED.clear()
    with compiles() as names:
        report = api.warmup(t, method="lookup", progress=False)
    assert report["programs"] == len(api.prompt_buckets(128)) + 1 == 5   # buckets 16, 32, 64, 128 and the loop
    assert names.count("spec_decode") == 1 and names.count("spec_prefill") == 4
    with compiles() as names:
        for n in (2, 20, 40, 90):
            generate(t, [[1 + i % 60 for i in range(n)]], max_new_tokens=7, method="lookup")
    assert "spec_decode" not in names and "spec_prefill" not in names


def test_generate_with_warmup_compiles_ahead_so_a_new_prompt_length_compiles_nothing():
    t = tiny_target(vocab=64, hidden=32, max_cache_len=64)
    api._COMPILED.clear()
    with compiles() as names:
        first = generate(t, [[3, 4, 5], [6, 7]], max_new_tokens=5, warmup=True)
    assert names.count("ar_decode") == 1 and names.count("ar_prefill") == len(api.prompt_buckets(64)) == 3
    assert first[0].stats["compile_seconds"] > 0
    with compiles() as names:
        later = [generate(t, [[1 + i % 60 for i in range(n)]] * 2, max_new_tokens=m) for n, m in ((20, 9), (40, 3))]
    assert names == [] and all(r.stats["compile_seconds"] == 0 for res in later for r in res)
    again = generate(t, [[3, 4, 5], [6, 7]], max_new_tokens=5)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]   # warmup changes no output


def _run_tiny(model: str, env: dict) -> dict:
    script = f"""
import json, jax
from jax._src import monitoring
hits = []
monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
from hsd_jax import api
t = api.load_target({model!r}, tokenizer=False, max_cache_len=128)
r = api.generate(t, [[5, 6, 7]], max_new_tokens=6)[0]
print(json.dumps({{"hits": len(hits), "dir": jax.config.jax_compilation_cache_dir, "ids": r.token_ids}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _with_the_suites_kernel(cache: str, monkeypatch) -> None:
    """Copy the CPU kernel library the suite built into a fresh user cache, so the processes under
    test load it instead of compiling it again (~15 s of CPU: the same sources, compiler and CPU)."""
    if not cpu_kernels.enabled():
        return
    built = kernel_build.library_path()
    with monkeypatch.context() as m:
        m.setenv("HSD_JAX_CACHE", cache)
        target = kernel_build.library_path()
    os.makedirs(os.path.dirname(target))
    shutil.copyfile(built, target)


def test_a_second_process_loads_the_first_ones_programs_and_weights(tmp_path, monkeypatch):
    model = tiny_smollm2_gguf(tmp_path / "model.gguf", hidden=32, heads=4, kv_heads=2)
    _with_the_suites_kernel(str(tmp_path / "user-cache"), monkeypatch)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(HSD_JAX_CACHE=str(tmp_path / "user-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=ROOT)
    first = _run_tiny(model, env)
    assert first["dir"] == os.path.join(str(tmp_path / "user-cache"), "xla") and first["hits"] == 0
    assert len(os.listdir(first["dir"])) >= 2            # prefill and decode programs, at least
    assert len([f for f in os.listdir(tmp_path / "user-cache" / "weights") if "-packed-" not in f]) == 1
    second = _run_tiny(model, env)
    assert second["hits"] >= 2 and second["ids"] == first["ids"]


def test_the_compilation_cache_keeps_the_callers_folder_and_turns_off(monkeypatch):
    assert compilation.enable() == os.environ["JAX_COMPILATION_CACHE_DIR"]   # the suite's own folder, kept
    saved = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("HSD_JAX_COMPILATION_CACHE", "0")
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert compilation.enable() is None and jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)


def test_a_corrupt_or_stale_weights_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path / "cache"))
    model = tiny_smollm2_gguf(tmp_path / "model.gguf", hidden=32, heads=4, kv_heads=2)
    # copied: a load serves the cache file's mapped pages, which the damage below writes into
    want = jax.tree.map(np.array, api.load_target(model, tokenizer=False).params)
    cached = weights_cache.cache_file(model)
    assert os.path.isfile(cached)

    def same(params):
        return all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)))

    assert same(api.load_target(model, tokenizer=False).params)     # read back
    size = os.path.getsize(cached)
    with open(cached, "r+b") as f:                                  # flip bytes inside a tensor
        f.seek(size - 1000)
        f.write(b"\x7f" * 16)
    with pytest.warns(UserWarning, match="stale or corrupt"):
        assert same(api.load_target(model, tokenizer=False).params)
    weights_cache.wait_for_writes()
    assert os.path.getsize(cached) == size                           # rebuilt
    with open(cached, "r+b") as f:
        f.truncate(size // 2)
    with pytest.warns(UserWarning, match="stale or corrupt"):
        assert same(api.load_target(model, tokenizer=False).params)
    weights_cache.wait_for_writes()
    with open(cached, "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.warns(UserWarning, match="stale or corrupt"):
        assert same(api.load_target(model, tokenizer=False).params)
    assert same(api.load_target(model, tokenizer=False).params)
    os.utime(model, ns=(1, 1))                                       # the source changed: a new key
    assert weights_cache.cache_file(model) != cached
    # its next store evicts the old version's files (derived ones too), never another file's
    folder = os.path.dirname(cached)
    derived = cached.replace(".safetensors", "-packed-float32-0123.safetensors")
    other = os.path.join(folder, "other_gguf-" + "ab" * 16 + ".safetensors")
    for path in (derived, other):
        with open(path, "wb") as f:
            f.write(b"x")
    assert same(api.load_target(model, tokenizer=False).params)
    weights_cache.wait_for_writes()
    assert sorted(os.listdir(folder)) == sorted([os.path.basename(weights_cache.cache_file(model)),
                                                 os.path.basename(other)])


def test_hsd_warmup_then_generate_compiles_nothing_and_verbose_says_where_time_went(tmp_path):
    model = tiny_smollm2_gguf(tmp_path / "model.gguf", hidden=32, heads=4, kv_heads=2)
    api._COMPILED.clear()
    warm = run_cli("warmup", "--model", model, "--method", "lookup", "--max-cache-len", "32")
    assert warm.returncode == 0, warm.stderr
    report = json.loads(warm.stdout.strip().splitlines()[-1])
    assert report["programs"] == len(api.prompt_buckets(32)) + 1 == 3
    assert report["compilation_cache"] == os.environ["JAX_COMPILATION_CACHE_DIR"]
    gen = run_cli("generate", "--model", model, "--method", "lookup", "--max-cache-len", "32",
                  "--prompt", "Give me three tips.", "--max-new-tokens", "5", "--verbose")
    assert gen.returncode == 0, gen.stderr
    assert "compile 0.00 s" in gen.stderr and "prefill" in gen.stderr and "decode" in gen.stderr
    bad = run_cli("warmup", "--model", model, "--batch-size", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --batch-size")


def test_the_packed_kernel_weights_are_cached_verified_and_rebuilt(tmp_path, monkeypatch):
    """A GGUF target's CPU-kernel packed layers and head screen (bf16) are read back from the weights
    cache by the next load instead of packed again; a corrupt copy is rebuilt, packing code other
    than the one that wrote them is never read back, and params replaced after the load are packed
    from themselves."""
    from hsd_jax import cpu_kernels

    if not cpu_kernels.enabled():   # built (or found) before the user cache below moves
        pytest.skip("the CPU kernels are not available")
    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path / "cache"))
    model = tiny_smollm2_gguf(tmp_path / "model.gguf", hidden=32, heads=4, kv_heads=2)
    packs = []
    pack_layers = cpu_kernels.pack_layers
    monkeypatch.setattr(cpu_kernels, "pack_layers", lambda layers, *a, **k: packs.append(1) or pack_layers(layers, *a, **k))

    def packed():
        return api.serving_params(api.load_target(model, tokenizer=False))["packed_kernels"]

    want = packed()
    weights_cache.wait_for_writes()
    assert len(packs) == 1 and {"q_proj", "mlp/down_proj", "head_screen"} <= set(want)
    assert want["head_screen"].dtype == jax.numpy.bfloat16
    files = [f for f in os.listdir(tmp_path / "cache" / "weights") if "-packed-float32-" in f]
    assert len(files) == 1
    cached = str(tmp_path / "cache" / "weights" / files[0])

    def same(got):
        return got.keys() == want.keys() and all(
            got[k].dtype == want[k].dtype and np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want)

    assert same(packed()) and len(packs) == 1                       # read back, not packed
    size = os.path.getsize(cached)
    for damage in ("flip", "truncate"):
        with open(cached, "r+b") as f:
            if damage == "flip":
                f.seek(size - 100)
                f.write(b"\x55" * 8)
            else:
                f.truncate(size // 2)
        with pytest.warns(UserWarning, match="stale or corrupt"):
            assert same(packed())
        weights_cache.wait_for_writes()
        assert os.path.getsize(cached) == size                       # rebuilt
    assert len(packs) == 3
    code = tmp_path / "cpu_kernels_init.py"                          # the packing code changed
    code.write_bytes(open(cpu_kernels.__file__, "rb").read() + b"\n# another packing layout\n")
    monkeypatch.setattr(cpu_kernels, "__file__", str(code))
    assert same(packed()) and len(packs) == 4
    weights_cache.wait_for_writes()
    assert len([f for f in os.listdir(tmp_path / "cache" / "weights") if "-packed-" in f]) == 2
    t = api.load_target(model, tokenizer=False)                    # params replaced after the load
    t.params = jax.tree.map(lambda a: a * 2, t.params)
    doubled = api.serving_params(t)["packed_kernels"]
    assert len(packs) == 5 and np.allclose(np.asarray(doubled["q_proj"]), 2 * np.asarray(want["q_proj"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_first_load_decodes_and_packs_straight_into_the_cache_files(tmp_path, monkeypatch, dtype):
    """A first load's f32 params (decoded; an f32 target's) and packed kernel weights are written into their cache files'
    mappings and served from them (`weights_cache.create`): the same arrays as a load with the cache
    off, and the next load reads those files back."""
    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels are not available")
    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path / "cache"))
    model = tiny_smollm2_gguf(tmp_path / "model.gguf", hidden=64, heads=4, kv_heads=2)

    def loaded():
        t = api.load_target(model, tokenizer=False, dtype=dtype)
        return t.params, api.serving_params(t)["packed_kernels"]

    monkeypatch.setenv(weights_cache.ENV, "0")
    fresh = jax.tree.map(np.array, loaded())
    monkeypatch.delenv(weights_cache.ENV)
    if dtype == "float32":   # (a bf16 target's f32 params are cast from a copy: `weights_cache.store`)
        monkeypatch.setattr(weights_cache, "store", lambda *a: pytest.fail("written from a copy"))
    monkeypatch.setattr(weights_cache, "store_derived", lambda *a: pytest.fail("written from a copy"))
    first = loaded()
    weights_cache.wait_for_writes()
    files = sorted(os.listdir(tmp_path / "cache" / "weights"))
    assert len(files) == 2 and not any(f.endswith(".tmp") for f in files)
    monkeypatch.setattr(weights_cache, "create", lambda *a: pytest.fail("not read back"))
    again = loaded()
    assert "head_screen" in first[1] if dtype == "float32" else "head" in first[1]
    for got in (first, again):
        assert jax.tree.structure(got) == jax.tree.structure(fresh)
        assert all(a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fresh)))


def test_a_full_disk_leaves_the_first_load_whole_and_no_file_behind(tmp_path, monkeypatch):
    """The in-place cache files reserve their blocks first: a full disk is a warning (no SIGBUS when a
    mapped page is written later), the load serves what a cache-off load does, no file is left."""
    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path / "cache"))
    model = tiny_smollm2_gguf(tmp_path / "model.gguf", hidden=32, heads=4, kv_heads=2)
    monkeypatch.setenv(weights_cache.ENV, "0")
    want = jax.tree.map(np.array, api.load_target(model, tokenizer=False).params)
    monkeypatch.delenv(weights_cache.ENV)

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights_cache.os, "posix_fallocate", full)
    with pytest.warns(UserWarning, match="could not write the weights cache.*No space left"):
        got = api.load_target(model, tokenizer=False)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want)))
    assert os.listdir(tmp_path / "cache" / "weights") == []


def test_loading_and_packing_for_the_cpu_kernels_compile_no_program(smol, caplog):
    """A drafter's load (the shipped one: bf16 params, cast to the f32 target's dtype) and the
    target's and drafter's packing for the CPU kernels (fresh, or mapped back from the weights cache)
    move arrays with `device_put`: `jnp.asarray` and `astype` compile a program for every new shape
    (~20 of them, ~0.5 s of a first process)."""
    import copy
    import logging

    from hsd_jax import cpu_kernels

    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels are not available")
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        for _ in range(2):      # packed here, then (the same source file) mapped back from the cache
            target = copy.copy(smol)
            target._packed = None
            drafter = load_drafter("hsd", target=target)
            assert drafter.params["layers"]["mlp"]["down_proj"]["kernel"].dtype == jax.numpy.float32
            assert "head_screen" in api.serving_params(target)["packed_kernels"]
            assert "draft_head" in api.serving_drafter_params(drafter, target)["packed_kernels"]
            weights_cache.wait_for_writes()
    assert [r.getMessage()[:80] for r in caplog.records if "Finished XLA compilation" in r.getMessage()] == []


def test_cache_writes_run_in_the_background_and_a_read_waits_for_them(tmp_path, monkeypatch):
    """A store returns before its file is written (a first load's writes overlap its compile); a
    read in the same process, and `wait_for_writes`, wait for it."""
    import threading
    import time

    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "source.bin"
    source.write_bytes(b"weights" * 100)
    release = threading.Event()
    write = weights_cache._write
    monkeypatch.setattr(weights_cache, "_write", lambda *a: release.wait(30) and write(*a))
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, jax.numpy.bfloat16)}
    weights_cache.store_derived(str(source), "v1", arrays)
    target = weights_cache.cache_file(str(source), "v1")
    assert not os.path.exists(target)                               # returned before writing
    threading.Timer(0.3, release.set).start()
    t0 = time.perf_counter()
    got = weights_cache.load_host(str(source), "v1")                # waits for the write
    assert time.perf_counter() - t0 >= 0.2 and os.path.isfile(target)
    assert got.keys() == arrays.keys() and all(
        got[k].dtype == arrays[k].dtype and np.array_equal(got[k], arrays[k]) for k in arrays)
    weights_cache.store_derived(str(source), "v2", arrays)
    weights_cache.wait_for_writes()
    assert os.path.isfile(weights_cache.cache_file(str(source), "v2")) and not weights_cache._WRITES


def test_cache_files_are_safetensors_files_that_its_own_reader_reads(tmp_path):
    """`weights_cache` writes its files itself (from each array's memory, no copy): safetensors'
    reader takes them, every dtype and shape (empty and 0-d too) and the metadata intact."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    flat = {"b/x": np.arange(12, dtype=np.float32).reshape(3, 4), "a": np.arange(5, dtype=np.int64),
            "c": np.ones((2, 3), np.uint16), "d": np.array([True, False]), "e": np.zeros((0, 4), np.float32),
            "f": np.float32(3.0).reshape(()), "g": np.arange(6, dtype=np.float64).reshape(2, 3).T}
    path = str(tmp_path / "x.safetensors")
    weights_cache._save(flat, path, {"source": "abc"})
    got = load_file(path)
    assert got.keys() == flat.keys()
    assert all(got[k].dtype == flat[k].dtype and np.array_equal(got[k], flat[k]) for k in flat)
    with safe_open(path, "np") as f:
        assert f.metadata() == {"source": "abc"}
    assert np.array_equal(weights_cache._mapped(path)[1]["g"], flat["g"])


def test_a_background_write_keeps_the_values_of_arrays_that_view_a_mapped_file(tmp_path, monkeypatch):
    """A GGUF's unquantized tensors view the mapped model file: a store copies them before it returns,
    so a file edited (or truncated: a SIGBUS) while the write runs cannot change or crash it, and
    files them under the fingerprint the source had then."""
    import threading

    from safetensors import safe_open

    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.bin"
    want = np.arange(64, dtype=np.float32)
    source.write_bytes(want.tobytes())
    view = np.memmap(source, dtype=np.float32, mode="r")[:64].reshape(8, 8)
    release = threading.Event()
    write = weights_cache._write
    monkeypatch.setattr(weights_cache, "_write", lambda *a: release.wait(30) and write(*a))
    weights_cache.store(str(source), {"norm": {"scale": view}})
    weights_cache.store_derived(str(source), "packed", {"norm": view})
    files = [weights_cache.cache_file(str(source), variant) for variant in ("", "packed")]
    with open(source, "r+b") as f:                                  # edited while the writes wait
        f.write(np.full(64, 7, np.float32).tobytes())
    release.set()
    weights_cache.wait_for_writes()
    for path in files:                                              # under the source they came from
        with safe_open(path, "np") as f:
            assert np.array_equal(f.get_tensor(f.keys()[0]).reshape(-1), want)
    assert weights_cache.load(str(source), {"norm/scale": (8, 8)}) is None   # the edited file: a miss


def test_a_drafter_checkpoint_is_read_back_from_the_weights_cache_without_orbax(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_JAX_CACHE", str(tmp_path / "cache"))
    target = tiny_target()
    path = str(tmp_path / "drafter")
    api.save_drafter(load_drafter("hsd", target=target, random_init=True), path)
    params_path = os.path.join(path, "params")
    want = load_drafter("hsd", path, target=target).params          # restored by Orbax, then cached
    cached = weights_cache.cache_file(params_path, api.ORBAX_CACHE_VARIANT)
    weights_cache.wait_for_writes()
    assert os.path.isfile(cached)

    def same(params):
        return (jax.tree.structure(params) == jax.tree.structure(want)
                and all(a.dtype == b.dtype and a.sharding == b.sharding and np.array_equal(a, b)
                        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want))))

    restore = api._restore_params
    monkeypatch.setattr(api, "_restore_params", lambda p: pytest.fail("restored by Orbax despite the cache"))
    assert same(load_drafter("hsd", path, target=target).params)
    monkeypatch.setattr(api, "_restore_params", restore)
    with open(cached, "r+b") as f:                                  # flip bytes inside a tensor
        f.seek(os.path.getsize(cached) - 100)
        f.write(b"\x7f" * 16)
    with pytest.warns(UserWarning, match="stale or corrupt"):
        assert same(load_drafter("hsd", path, target=target).params)
    weights_cache.wait_for_writes()
    assert os.path.isfile(cached)                                   # rebuilt
    ckpt_file = next(os.path.join(d, f) for d, _, fs in os.walk(params_path) for f in fs)
    os.utime(ckpt_file, ns=(1, 1))                                  # the checkpoint changed: a new key
    assert weights_cache.cache_file(params_path, api.ORBAX_CACHE_VARIANT) != cached


def test_importing_the_package_loads_no_jax_and_the_cli_starts_the_kernel_build_first(tmp_path):
    """`import hsd_jax` is light (its public names load on first use), so `hsd` (`hsd_jax.__main__`)
    starts a first run's CPU kernel build before JAX's imports: here, on an empty cache, the build
    is under way while `jax` is still not imported (its compiler `false`: no second real build)."""
    code = textwrap.dedent("""
        import json, os, sys, time
        import hsd_jax
        light = "jax" not in sys.modules
        from hsd_jax import kernel_build
        try:
            hsd_jax.no_such_name
            missing = "no error"
        except AttributeError as e:
            missing = str(e)
        kernel_build.start()
        started = kernel_build.pending() is not None and "jax" not in sys.modules
        kernel_build.wait()
        failed = kernel_build.pending().exception() is not None and not os.path.exists(kernel_build.library_path())
        from hsd_jax import load_target, ModelLoadError
        print(json.dumps({"light": light, "missing": missing, "started": started, "failed": failed,
                          "exports": callable(load_target) and issubclass(ModelLoadError, Exception),
                          "cpu": kernel_build.cpu_likely()}))
    """)
    env = dict(os.environ, HSD_JAX_CACHE=str(tmp_path), JAX_PLATFORMS="cpu", CXX="false")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"light": True, "missing": "module 'hsd_jax' has no attribute 'no_such_name'", "started": True,
                   "failed": True, "exports": True, "cpu": True}


def test_the_early_build_is_skipped_where_jax_may_run_on_an_accelerator(monkeypatch):
    from hsd_jax import kernel_build

    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not kernel_build.cpu_likely()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert kernel_build.cpu_likely()
    # unset: by the installed plugins; libtpu alone (for `hsd compile`) counts only where a TPU shows
    monkeypatch.delenv("JAX_PLATFORMS")
    # a fresh cache of the plugin scan for this test (restored after it, with its real scan)
    monkeypatch.setattr(kernel_build, "_accelerator_plugins", functools.cache(kernel_build._accelerator_plugins.__wrapped__))
    for plugins, tpu, cpu in (((), False, True), (("libtpu",), False, True), (("libtpu",), True, False),
                              (("jax_cuda12_plugin",), False, False), (("libtpu", "jax_plugins"), False, False)):
        monkeypatch.setattr(kernel_build.pkgutil, "iter_modules",
                            lambda p=plugins: [types.SimpleNamespace(name=n) for n in ("numpy", *p)])
        monkeypatch.setattr(kernel_build, "tpu_present", lambda t=tpu: t)
        kernel_build._accelerator_plugins.cache_clear()
        assert kernel_build.cpu_likely() is cpu, (plugins, tpu)
        assert kernel_build.libtpu_without_tpu() is (plugins == ("libtpu",) and not tpu), (plugins, tpu)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")   # the user's choice stands
    assert not kernel_build.libtpu_without_tpu()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None or kernel_build.tpu_present(),
                    reason="needs libtpu installed on a machine without a TPU")
def test_load_target_skips_libtpu_where_no_tpu_shows(tmp_path):
    """With libtpu installed and no TPU, JAX would start libtpu, log its failure as an error and fall
    back to the CPU: `load_target` asks for the CPU first (JAX_PLATFORMS unset)."""
    code = textwrap.dedent("""
        import jax
        from hsd_jax import load_target
        load_target(tokenizer=False, max_cache_len=64)
        print(jax.default_backend(), jax.config.jax_platforms)
    """)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(HSD_JAX_CACHE=str(tmp_path), HSD_CPU_KERNELS="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["cpu", "cpu"]
    assert "TPU_WORKER_HOSTNAMES" not in r.stderr and "libtpu" not in r.stderr, r.stderr[-2000:]


def test_the_cli_starts_no_early_build_for_a_multi_process_run(monkeypatch):
    """Such a run uses no CPU kernel (every program on a mesh), and its other processes write no file."""
    import hsd_jax.__main__ as entry
    import hsd_jax.cli

    starts = []
    monkeypatch.setattr(kernel_build, "start", lambda: starts.append(1))
    monkeypatch.setattr(hsd_jax.cli, "main", lambda: 0)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("HSD_CPU_KERNELS", raising=False)
    for env in ({"HSD_COORDINATOR": "127.0.0.1:1234", "HSD_NUM_PROCESSES": "2", "HSD_PROCESS_ID": "1"},
                {"HSD_DISTRIBUTED": "auto"}, {}):
        for k in ("HSD_COORDINATOR", "HSD_NUM_PROCESSES", "HSD_PROCESS_ID", "HSD_DISTRIBUTED"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert entry.main() == 0
    assert starts == [1]                      # the single-process run alone
