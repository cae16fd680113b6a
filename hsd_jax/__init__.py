"""hsd-jax: Hidden-State Speculative Decoding (arXiv 2602.21224) in JAX/Flax.

The public names are imported on first use (PEP 562), so `import hsd_jax` alone loads no JAX: the
CLI (`hsd_jax.__main__`) starts a first run's CPU kernel build before JAX's imports."""
import importlib

_EXPORTS = {
    "load_target": "hsd_jax.api", "load_drafter": "hsd_jax.api", "save_drafter": "hsd_jax.api",
    "generate": "hsd_jax.api", "warmup": "hsd_jax.api", "Target": "hsd_jax.api",
    "GenerationResult": "hsd_jax.api", "InputError": "hsd_jax.api",
    "ModelConfig": "hsd_jax.config", "SamplingConfig": "hsd_jax.config", "ConfigError": "hsd_jax.config",
    "ModelLoadError": "hsd_jax.loading.errors",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hsd_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
