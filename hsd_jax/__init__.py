"""hsd-jax: Hidden-State Speculative Decoding (arXiv 2602.21224) in JAX/Flax."""
from hsd_jax.api import (
    GenerationResult,
    InputError,
    Target,
    generate,
    load_drafter,
    load_target,
    save_drafter,
    warmup,
)
from hsd_jax.config import ConfigError, ModelConfig, SamplingConfig
from hsd_jax.loading.errors import ModelLoadError

__all__ = ["load_target", "load_drafter", "save_drafter", "generate", "warmup", "Target", "GenerationResult", "ModelConfig", "SamplingConfig",
           "ConfigError", "InputError", "ModelLoadError"]
__version__ = "0.1.0"
