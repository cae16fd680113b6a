"""Building blocks shared by the target model and the drafters: RMSNorm, RoPE, SwiGLU."""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.config import ModelConfig, RopeScaling


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """LLaMA RMSNorm computed in f32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return rms_norm(x, scale, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies with Hugging Face's `default`, `linear` and `llama3` rules."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling.rope_type == "linear":
        inv = inv / scaling.factor
    elif scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, H, Dh]; positions: [B, T] int."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.cos(jnp.concatenate([ang, ang], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([ang, ang], -1))[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rot * sin).astype(x.dtype)


class SwiGLU(nn.Module):
    hidden: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: nn.Dense(n, use_bias=self.use_bias, dtype=self.dtype,
                                         param_dtype=self.dtype, name=name)
        h = nn.silu(dense(self.hidden, "gate_proj")(x)) * dense(self.hidden, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(h)


def jnp_dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


# One-shot random initialisers on the CPU: XLA's optimiser would take longer than the run.
INIT_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def init_program(*static: str):
    """Decorator: run a random initialiser as one jitted program (arguments named in `static` are
    static), compiled without XLA:CPU's optimiser on the CPU. Op by op, an init's dozens of small
    ops each compile on their own: seconds per new model shape (tests build many)."""
    def wrap(fn):
        jitted = {}

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((args, kwargs))):
                return fn(*args, **kwargs)   # inside another initialiser's program
            cpu = jax.default_backend() == "cpu"
            if cpu not in jitted:
                jitted[cpu] = jax.jit(fn, static_argnames=static,
                                      compiler_options=INIT_COMPILE_OPTIONS if cpu else None)
            return jitted[cpu](*args, **kwargs)
        return call
    return wrap
