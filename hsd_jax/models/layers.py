"""Building blocks shared by the target model and the drafters: RMSNorm, RoPE, SwiGLU, and the
matmul that training can run on bf16 inputs (`matmul_inputs`)."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.config import ModelConfig, RopeScaling

_MATMUL_INPUTS = contextvars.ContextVar("hsd_matmul_inputs", default=None)


@contextlib.contextmanager
def matmul_inputs(dtype):
    """While tracing inside this context, `dot_general` and `matmul` cast both operands of every f32
    matmul to `dtype` (bfloat16) and accumulate in f32: mixed precision for training with f32 master
    weights, f32 norms, softmaxes and losses. On the CPU, XLA runs bf16 x bf16 -> f32 dots with
    AVX-512 BF16 (~2x f32's GFLOP/s here) but bf16 -> bf16 dots no faster than f32, so the output
    stays f32. None: a no-op (the default everywhere else)."""
    token = _MATMUL_INPUTS.set(None if dtype is None else jnp.dtype(dtype))
    try:
        yield
    finally:
        _MATMUL_INPUTS.reset(token)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    """`lax.dot_general`, but an f32 `x @ w` (x's last axis against w's first, as Dense computes it)
    runs on `matmul_inputs`' dtype when that context is set."""
    dt = _MATMUL_INPUTS.get()
    plain = dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and rhs.ndim == 2
    if dt is None or not plain or lhs.dtype != jnp.float32 or rhs.dtype != jnp.float32:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision,
                                   preferred_element_type=preferred_element_type, **kw)
    return _mixed_matmul(lhs, rhs, dt)


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` for b [k, n], per `matmul_inputs`."""
    return dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())))


def _low_dot(a, b, dt, dims):
    return jax.lax.dot_general(a.astype(dt), b.astype(dt), (dims, ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mixed_matmul(x, w, dt):
    """x [..., k] @ w [k, n] on dt inputs with f32 accumulation, forward and backward: JAX's own
    transpose of a mixed dot would run the two gradient matmuls in f32."""
    return _low_dot(x, w, dt, ((x.ndim - 1,), (0,)))


def _mixed_matmul_fwd(x, w, dt):
    return _mixed_matmul(x, w, dt), (x.astype(dt), w.astype(dt))


def _mixed_matmul_bwd(dt, res, g):
    x, w = res
    gx = _low_dot(g, w, dt, ((g.ndim - 1,), (1,)))
    lead = tuple(range(x.ndim - 1))
    gw = _low_dot(x, g, dt, (lead, lead))
    return gx, gw


_mixed_matmul.defvjp(_mixed_matmul_fwd, _mixed_matmul_bwd)


def take(table: jax.Array, indices: jax.Array, axis: int = 0) -> jax.Array:
    """`jnp.take`, a bf16 table gathered as its uint16 bits (the same values): XLA:CPU widens a bf16
    gather's whole table to f32 first, and hoisted out of the decode loop that is one convert of the
    embedding per call (SmolLM2: 113 MB written, ~36 ms, in the prefill and again in the loop)."""
    if table.dtype != jnp.bfloat16:
        return jnp.take(table, indices, axis=axis)
    bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), indices, axis=axis)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


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
                                         param_dtype=self.dtype, dot_general=dot_general, name=name)
        # SiLU in f32, rounded once, as transformers' bf16 path computes it (opmath): XLA's bf16 silu rounds
        # after each of its four ops (and on the CPU that fusion took ~11 us a call, against ~5 now)
        gate = dense(self.hidden, "gate_proj")(x)
        h = nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * dense(self.hidden, "up_proj")(x)
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
