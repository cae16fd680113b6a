"""Shared, session-scoped models: loading SmolLM2 (JAX and PyTorch) once for the whole suite, and
one XLA compilation cache and one user cache (tuned trees, the CPU kernel's build) for the whole run.

Most of the suite's time is XLA compiling decode loops, and many modules, subprocesses and
notebook kernels compile the same programs (the same model at the same shapes). They share one
persistent compilation cache: a fresh folder per run (so a run's time is a cold run's time), or
the folder in JAX_COMPILATION_CACHE_DIR when the caller sets one (kept between runs)."""
import atexit
import os
import shutil
import tempfile

import jax
import pytest

from tests.helpers import SUITE_XLA_FLAGS

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="hsd-tests-xla-cache-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE         # subprocesses and kernels inherit it
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
if "HSD_JAX_CACHE" not in os.environ:   # the user cache (tuned trees, the built CPU kernel): fresh per run too
    _HSD_CACHE = tempfile.mkdtemp(prefix="hsd-tests-cache-")
    atexit.register(shutil.rmtree, _HSD_CACHE, ignore_errors=True)
    os.environ["HSD_JAX_CACHE"] = _HSD_CACHE
# Every program here runs for milliseconds, SmolLM2's too, so XLA:CPU's fast-compile options (what
# `api.compile_options` picks for tiny models) cut the suite's CPU time by a fifth (test_shipped_drafters:
# 94 s -> 72 s user CPU, measured alternately). Set before any backend starts: workers, subprocesses
# and notebook kernels inherit XLA_FLAGS. What the tests assert (speculative vs ar tokens within a
# run, PyTorch parity within tolerances) holds at any optimisation level; README command 1 in CI runs
# SmolLM2 at XLA's defaults.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), SUITE_XLA_FLAGS]))
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])   # if a plugin imported jax first
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


# Modules longest first (seconds of pytest time in a full run on 2 cores, 2026-12-03, quiet machine;
# test_device_pack, test_sharding and test_multihost run subprocesses from module fixtures): under
# `pytest -n 2 --dist loadfile --no-loadscope-reorder` (README) each worker takes the next module when
# it is nearly done with its own, so the short ones fill in at the end and neither worker is left
# running a long module alone (the longest-first rule). Modules not listed run last.
LONG_MODULES = ("test_speculative.py", "test_notebooks.py", "test_training.py", "test_qwen3.py",   # 159 105 102 96
                "test_device_pack.py", "test_sharding.py", "test_multihost.py", "test_shipped_drafters.py",  # 92 79 65 65
                "test_compile.py", "test_model_parity.py", "test_tune.py", "test_cpu_kernels.py",  # 64 40 35 33
                "test_startup.py", "test_speculative_smollm2.py", "test_bench.py", "test_eagle3.py",  # 31 29 27 25
                "test_lookup.py", "test_serving_head.py", "test_exact.py", "test_tokenizer.py",  # 22 21 17 16
                "test_tree.py", "test_corruption.py", "test_generate.py", "test_tree_attention.py",  # 13 13 13 9
                "test_sharded_loading.py", "test_ngram.py", "test_model_attention_impl.py", "test_loading_and_cli.py")


def pytest_configure(config):
    """The controller (or a run without workers) starts building the CPU kernel (~11 s of one core)
    while the workers start: the workers' collection (test_cpu_kernels asks whether it is built) and
    every subprocess then wait on its lock (`kernel_build.build`) instead of each building it too."""
    if not hasattr(config, "workerinput"):
        from hsd_jax import cpu_kernels

        cpu_kernels.prebuild()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_MODULES)))   # stable: file order otherwise


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct in JAX (f32, reference attention on CPU)."""
    from hsd_jax.api import load_target

    return load_target("smollm2-135m", max_cache_len=1024)


@pytest.fixture(scope="session")
def smol_torch():
    """The same GGUF loaded by transformers' PyTorch implementation: the correctness reference."""
    torch = pytest.importorskip("torch")
    import functools
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM

    from hsd_jax.loading.gguf_loader import default_gguf_path

    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)   # a core per xdist worker
    path = default_gguf_path()
    # transformers' GGUF conversion as it is, with two of its pure calls memoised for this load: it
    # parses the file twice (config, then weights) and builds gguf's tensor-name map once per module
    # of the model (~12 of this fixture's ~18 s)
    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def mt_prompts():
    from hsd_jax.prompts import load_suite

    return load_suite("mt_bench")


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Drop compiled programs after each test module: the suite compiles hundreds of decode loops
    in one process, and holding every executable to the end grows memory without bound."""
    yield
    from hsd_jax import api

    api._COMPILED.clear()
    jax.clear_caches()
