"""Feature drafters: HSD (token-free hidden-state chain, late token injection) and EAGLE-style.

Both are one (or a few) LLaMA decoder layers over feature vectors, with their own KV
cache, reading tokens out through the target's frozen final norm and LM head restricted
to a reduced draft vocabulary (`d2t` maps draft ids to target ids).

- HSD: z_p = f_p (true target features) or g_p (its own predictions); the layer maps
  z_{<=p} to g_{p+1}. No token enters the recurrence. Tokens enter only in the read-out
  `inject`: logits(x_{q+1}) = Head(I(g_q, x_q)), `fused` (MLP over [rms g; rms e(x)],
  zero-init output scaled by the feature RMS) or `additive` (g + s * rms(e(x)) W).
- EAGLE: z_q = FC([f_q; c * rms e(x_{q+1})]); the layer predicts f_{q+1}; read-out `plain`
  Head(norm g) or the same `fused` MLP as HSD, so the comparison is fair.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax import cpu_kernels
from hsd_jax.config import ModelConfig, _require
from hsd_jax.models import llama
from hsd_jax.models.layers import init_program, matmul, rms_norm, take

KINDS = ("hsd", "eagle")
INJECTIONS = ("fused", "additive")
READOUTS = ("plain", "fused")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A feature drafter for a given target width. Hashable: a static jit argument."""

    kind: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_layers: int = 1
    vocab_size: int = 0            # the target's vocab
    draft_vocab_size: int = 0      # 0 = full vocab
    injection: str = "fused"       # hsd
    readout: str = "fused"         # eagle: plain or fused
    inj_hidden: int = 0            # fused MLP width (0 = 2 * hidden)
    readout_context: int = 1       # path tokens the fused read-out sees: the current one and context-1 before it
    feature_layers: tuple[int, ...] = ()   # target layers fused into the input (EAGLE-3 style)
    feature_rms: float = 1.0       # scale c of injected terms (the target features' RMS)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        _require(self.kind in KINDS, f"drafter kind must be one of {KINDS}, got {self.kind!r}")
        _require(self.injection in INJECTIONS, f"injection must be one of {INJECTIONS}, got {self.injection!r}")
        _require(self.readout in READOUTS, f"readout must be one of {READOUTS}, got {self.readout!r}")
        for name in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "num_layers", "vocab_size"):
            _require(getattr(self, name) > 0, f"drafter {name} must be positive, got {getattr(self, name)}")
        _require(0 <= self.draft_vocab_size <= self.vocab_size,
                 f"draft_vocab_size must be in [0, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        _require(self.feature_rms > 0, "feature_rms must be > 0")
        _require(1 <= self.readout_context <= 4, f"readout_context must be in [1, 4], got {self.readout_context}")
        _require(self.readout_context == 1 or self.uses_fused_readout,
                 "readout_context > 1 needs the fused read-out (injection/readout 'fused')")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        _require(self.kind == "hsd" or not self.feature_layers, "feature_layers fusion is implemented for hsd only")

    @property
    def vd(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def mlp_hidden(self) -> int:
        return self.inj_hidden or 2 * self.hidden_size

    @property
    def uses_fused_readout(self) -> bool:
        return self.injection == "fused" if self.kind == "hsd" else self.readout == "fused"

    def layer_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, rope_theta=self.rope_theta,
                           rms_norm_eps=self.rms_norm_eps, attention_impl="reference", tie_word_embeddings=True)

    def check_target(self, target_cfg: ModelConfig) -> None:
        """Refuse a drafter that does not fit the target, naming the mismatch."""
        _require(self.hidden_size == target_cfg.hidden_size,
                 f"drafter hidden size {self.hidden_size} does not match the target's {target_cfg.hidden_size}")
        _require(self.vocab_size == target_cfg.vocab_size,
                 f"drafter vocab {self.vocab_size} does not match the target's {target_cfg.vocab_size}")
        for i in self.feature_layers:
            _require(0 <= i < target_cfg.num_layers,
                     f"drafter feature layer {i} does not exist in a target with {target_cfg.num_layers} layers")

    @classmethod
    def for_target(cls, kind: str, target_cfg: ModelConfig, **kw) -> "DrafterConfig":
        """A one-layer drafter shaped like one of the target's layers."""
        base = dict(hidden_size=target_cfg.hidden_size, num_heads=target_cfg.num_heads,
                    num_kv_heads=target_cfg.num_kv_heads, intermediate_size=target_cfg.intermediate_size,
                    vocab_size=target_cfg.vocab_size, rope_theta=target_cfg.rope_theta,
                    rms_norm_eps=target_cfg.rms_norm_eps)
        base.update(kw)
        return cls(kind=kind, **base)


class TargetView(NamedTuple):
    """The frozen pieces of the target a drafter reads, built once per generate call."""

    head: jax.Array        # [d, V_d] LM head columns of the draft vocabulary
    norm_scale: jax.Array  # [d] final norm
    embedding: jax.Array   # [V, d] token embeddings
    d2t: jax.Array         # [V_d] draft id -> target id
    packed_head: jax.Array | None = None   # `head` packed for cpu_kernels [1, V_d / 32, d, 32], when served so


def target_view(target_params, target_cfg: ModelConfig, d2t, packed_head=None) -> TargetView:
    head = llama.lm_head_weight(target_params, target_cfg)
    d2t = jnp.asarray(d2t, jnp.int32)
    return TargetView(take(head, d2t, axis=1), target_params["norm"]["scale"],
                      target_params["embed_tokens"]["embedding"], d2t, packed_head)


def pack_draft_head(target_params, target_cfg: ModelConfig, d2t, dtype=jnp.float32) -> jax.Array | None:
    """The draft-vocab head [d, V_d] packed for `cpu_kernels.stacked_matmul` in `dtype` (f32:
    exact), or None when V_d is not a whole number of the kernel's column tiles."""
    if len(d2t) % cpu_kernels.COLS:
        return None
    ids = np.asarray(d2t)
    if target_cfg.tie_word_embeddings:   # the draft vocabulary's rows, then transposed: not the whole [d, V]
        head = np.asarray(target_params["embed_tokens"]["embedding"])[ids].T
    else:
        head = np.asarray(target_params["lm_head"]["kernel"])[:, ids]
    return cpu_kernels.on_cpu(cpu_kernels.pack(head.astype(np.float32)[None], dtype))


def packed_matmul(x: jax.Array, w: jax.Array, packed: jax.Array | None) -> jax.Array:
    """`matmul(x, w)` for x [..., n], w [n, m], through `cpu_kernels.stacked_matmul` from w's packed copy
    ([1, ceil(m / 32), n, 32]; its padding columns dropped) where one is given, at decode sizes (up to
    MAX_ROWS rows); in w's dtype either way. For the drafters' matrices served on the kernels
    (EAGLE-3's too)."""
    rows = x.size // x.shape[-1]
    if packed is None or rows > cpu_kernels.MAX_ROWS:
        return matmul(x, w)
    y = cpu_kernels.stacked_matmul(x.reshape(rows, x.shape[-1]), packed, 0)[:, :w.shape[-1]]
    return y.reshape(*x.shape[:-1], w.shape[-1]).astype(w.dtype)


def draft_logits(view: TargetView, h: jax.Array) -> jax.Array:
    """f32 logits over the draft vocabulary from normed features h [..., d]: through the packed
    head with the CPU kernel at decode sizes (XLA:CPU repacks the 19 MB head on every 2+-row
    GEMM), else XLA's dot."""
    return packed_matmul(h, view.head.astype(jnp.float32), view.packed_head)


def target_to_draft(d2t, vocab_size: int) -> np.ndarray:
    """The inverse of the draft-vocab map: target id -> draft id, -1 outside the draft vocabulary."""
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[np.asarray(d2t)] = np.arange(len(d2t), dtype=np.int32)
    return t2d


def _unit_rms(x):
    """x scaled to unit RMS (no learned scale): puts features (~30) and embeddings (~0.1) on par."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)


def fused_readout_params(key: jax.Array, n_in: int, hidden: int, d: int) -> dict:
    """The fused read-out MLP's weights: zero output layer, so it starts as the plain read-out."""
    return {"w1": 0.02 * jax.random.normal(key, (n_in, hidden)), "b1": jnp.zeros((hidden,)), "w2": jnp.zeros((hidden, d))}


READOUT_PACKED = ("w1", "w2")   # the fused read-out's matrices, packed as packed_kernels["readout_w1"], ...


def pack_readout(inject: dict, dtype) -> dict:
    """The fused read-out's w1 and w2 packed for `cpu_kernels.stacked_matmul` in `dtype`
    ({"readout_w1": [1, hidden / 32, n_in, 32], "readout_w2": ...}), those whose output width is a
    whole number of the kernel's column tiles: at a round's 1-3 rows XLA's f32 dots on them cost
    0.5 ms of a 13.8 ms hsd round (Zen 5; BENCHMARKS.md, "The drafter's share"); bf16 is half the bytes."""
    return {f"readout_{k}": cpu_kernels.on_cpu(cpu_kernels.pack(np.asarray(inject[k], np.float32)[None], dtype))
            for k in READOUT_PACKED if inject[k].shape[-1] % cpu_kernels.COLS == 0}


def fused_readout(p: dict, g: jax.Array, tokens: list, scale: float, packed: dict | None = None) -> jax.Array:
    """g + scale * MLP([rms g; tokens...]): the read-out's view of the draft token(s) (unit-RMS
    embeddings), added to the drafter's state before the head. `packed`: `pack_readout`'s copies
    (a served drafter's `packed_kernels`), used where present."""
    packed = packed or {}
    x = jnp.concatenate([_unit_rms(g), *tokens], -1)
    hid = jax.nn.silu(packed_matmul(x, p["w1"], packed.get("readout_w1")) + p["b1"])
    return g + scale * packed_matmul(hid, p["w2"], packed.get("readout_w2"))


@init_program("cfg")
def init_drafter_params(cfg: DrafterConfig, key: jax.Array) -> dict:
    k_layer, k_fc, k_inj = jax.random.split(key, 3)
    d = cfg.hidden_size
    params: dict = {"layers": llama.init_params(cfg.layer_config(), k_layer)["layers"]}
    n_in = d * max(len(cfg.feature_layers), 1)
    if cfg.kind == "eagle" or cfg.feature_layers:
        n_fc = n_in + (d if cfg.kind == "eagle" else 0)
        eye = jnp.zeros((n_fc, d)).at[n_in - d: n_in].set(jnp.eye(d))
        params["fc"] = {"kernel": eye + 0.01 * jax.random.normal(k_fc, (n_fc, d))}
    if cfg.uses_fused_readout:
        params["inject"] = fused_readout_params(k_inj, d * (1 + cfg.readout_context), cfg.mlp_hidden, d)
    elif cfg.kind == "hsd":
        params["inject"] = {"w": jnp.zeros((d, d))}
    return params


def readout(params: dict, cfg: DrafterConfig, view: TargetView, g: jax.Array, tokens: jax.Array,
            context: jax.Array | None = None) -> jax.Array:
    """Draft-vocab logits [..., V_d] for the token after `tokens`, from drafter features g [..., d].

    context [..., readout_context - 1]: the path's tokens before `tokens`, most recent first
    (only with `readout_context` > 1). They enter the read-out only: the chain stays token-free."""
    e = _unit_rms(take(view.embedding, tokens, axis=0))
    gf = g.astype(jnp.float32)
    if cfg.uses_fused_readout:
        more = [] if cfg.readout_context == 1 else [
            _unit_rms(take(view.embedding, context[..., i], axis=0)) for i in range(cfg.readout_context - 1)]
        gf = fused_readout(params["inject"], gf, [e, *more], cfg.feature_rms, params.get("packed_kernels"))
    elif cfg.kind == "hsd":
        gf = gf + cfg.feature_rms * matmul(e, params["inject"]["w"])
    return draft_logits(view, rms_norm(gf, view.norm_scale, cfg.rms_norm_eps))


def input_features(params: dict, cfg: DrafterConfig, last: jax.Array, aux: jax.Array | None) -> jax.Array:
    """HSD z for true target features: the last layer's, or FC over the configured layers [..., d]."""
    if not cfg.feature_layers:
        return last
    return matmul(jnp.concatenate(list(aux), -1), params["fc"]["kernel"])


def eagle_inputs(params: dict, cfg: DrafterConfig, view: TargetView, feats: jax.Array,
                 next_tokens: jax.Array) -> jax.Array:
    """EAGLE z_q = FC([f_q; c * rms e(x_{q+1})])."""
    e = cfg.feature_rms * _unit_rms(take(view.embedding, next_tokens, axis=0))
    return matmul(jnp.concatenate([feats.astype(jnp.float32), e], -1), params["fc"]["kernel"])


def run_layers(params: dict, cfg: DrafterConfig, z, positions, cache, parents=None):
    """The drafter's decoder layer(s) over inputs z [B, T, d]; returns (outputs [B, T, d], cache).

    The layer computes in its weights' dtype (bf16 beside a bf16 target, f32 in training)."""
    dtype = jnp.dtype(params["layers"]["q_proj"]["kernel"].dtype)
    lcfg = cfg.layer_config().replace(dtype=dtype.name)
    out = llama.forward_embeddings(params, lcfg, z.astype(dtype), positions, cache, parents)
    return out.features, out.cache


@dataclasses.dataclass
class Drafter:
    """A loaded drafter: params pytree, config and draft-vocab map (or an SD draft LM)."""

    kind: str
    params: Any
    config: Any
    d2t: np.ndarray | None = None
    path: str | None = None
    _packed: Any = dataclasses.field(default=None, repr=False, compare=False)   # (params, target params, dtype, packed copies)
