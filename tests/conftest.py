"""Shared, session-scoped models: loading SmolLM2 (JAX and PyTorch) once for the whole suite."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct in JAX (f32, reference attention on CPU)."""
    from hsd_jax.api import load_target

    return load_target("smollm2-135m", max_cache_len=1024)


@pytest.fixture(scope="session")
def smol_torch():
    """The same GGUF loaded by transformers' PyTorch implementation: the correctness reference."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from hsd_jax.loading.gguf_loader import default_gguf_path

    torch.set_num_threads(2)
    path = default_gguf_path()
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
    import jax

    from hsd_jax import api

    api._COMPILED.clear()
    jax.clear_caches()
