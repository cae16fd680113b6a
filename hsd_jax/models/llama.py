"""LLaMA-family target model as pure functions over an explicit Flax (Linen) param pytree.

One forward serves prefill (T tokens, causal), decode (1 token) and verify (N tree
nodes at explicit positions with an ancestor mask). Layers are stacked along a
leading axis and run with `lax.scan`. The forward writes the new K/V at slots
lengths[b] + i of the cache and returns the pre-norm features of the last layer
(what drafters read) plus the outputs of `cfg.feature_layers`.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from hsd_jax import cpu_kernels
from hsd_jax.cache import KVCache, init_cache, widen, write_layer
from hsd_jax.config import ModelConfig
from hsd_jax.models.layers import (
    RMSNorm,
    SwiGLU,
    apply_rope,
    dot_general,
    init_program,
    jnp_dtype,
    rms_norm,
    rope_inv_freq,
    take,
)
from hsd_jax.sampling import argmax
from pallas_kernels.tree_attention import ancestor_mask, impl_backend, resolve_attention_impl, tree_attention


class ForwardOutput(NamedTuple):
    features: jax.Array        # [B, T, d] last decoder layer output, before the final norm
    aux_features: jax.Array    # [n_feature_layers, B, T, d] (size 0 when none configured)
    cache: KVCache             # entries written, lengths unchanged


def causal_attention(q, k_cache, v_cache, lengths):
    """Prefill attention: query t of sequence b sees cache slots <= lengths[b] + t.

    q: [B, Hq, T, Dh]; k_cache, v_cache: [B, Hkv, S, Dh]. GQA by grouping, no K/V repeat.
    """
    b, hq, t, dh = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, t, dh).astype(jnp.float32)
    scores = jnp.einsum("bhgtd,bhsd->bhgts", qg, k_cache.astype(jnp.float32)) / jnp.sqrt(dh).astype(jnp.float32)
    limit = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    visible = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= limit[:, :, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bhsd->bhgtd", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, hq, t, dh).astype(q.dtype)


def xla_attention(q, k_cache, v_cache, lengths, parents, impl: str):
    """`causal_attention` (parents None) or `tree_attention` (`impl`) over token-major q [B, T, Hq, Dh],
    the layers' layout, output likewise: both compute head-major, so q goes in and out transposed."""
    qh = q.transpose(0, 2, 1, 3)
    if parents is None:
        out = causal_attention(qh, k_cache, v_cache, lengths)
    else:
        out = tree_attention(qh, k_cache, v_cache, lengths, parents, impl=resolve_attention_impl(impl))
    return out.transpose(0, 2, 1, 3)


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        dt = jnp_dtype(cfg)
        dense = lambda n, bias: nn.Dense(n, use_bias=bias, dtype=dt, param_dtype=dt, dot_general=dot_general)
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, dt)
        self.q_proj = dense(cfg.num_heads * cfg.head_dim, cfg.attention_bias)
        self.k_proj = dense(cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.v_proj = dense(cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.o_proj = dense(cfg.hidden_size, False)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, dt)
        self.mlp = SwiGLU(cfg.intermediate_size, cfg.mlp_bias, dt)
        if cfg.qk_norm:   # Qwen3: RMSNorm over each head's [Dh] before RoPE
            self.q_norm = RMSNorm(cfg.rms_norm_eps, dt)
            self.k_norm = RMSNorm(cfg.rms_norm_eps, dt)

    def project(self, x, positions):
        """Rotated q [B, T, Hq, Dh] and k, v [B, T, Hkv, Dh] of inputs x [B, T, d]."""
        cfg = self.cfg
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q = self.q_proj(h).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(h).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        v = self.v_proj(h).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def output(self, x, attn):
        """Residual attention output (attn [B, T, Hq, Dh]) then the residual MLP."""
        b, t, _ = x.shape
        x = x + self.o_proj(attn.reshape(b, t, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, positions, cache_k, cache_v, layer, lengths, parents, ancestors=None):
        """ancestors [B, T, T] (given only where `cpu_kernels.tree_attention` serves this forward):
        attention reads the stacked cache in place with that visibility; parents is then unused."""
        q, k, v = self.project(x, positions)
        cache_k = write_layer(cache_k, layer, k, lengths)
        cache_v = write_layer(cache_v, layer, v, lengths)
        if ancestors is not None:
            attn = cpu_kernels.tree_attention(q, cache_k, cache_v, layer, lengths, ancestors,
                                              1.0 / math.sqrt(self.cfg.head_dim), token_major=True).astype(q.dtype)
            return self.output(x, attn), cache_k, cache_v
        attn = xla_attention(q, cache_k[layer], cache_v[layer], lengths, parents, self.cfg.attention_impl)
        return self.output(x, attn), cache_k, cache_v


@init_program("cfg", "init_std")
def init_params(cfg: ModelConfig, key: jax.Array, init_std: float = 0.02) -> dict:
    """Random parameters (tests, drafters). Layer params are stacked on axis 0."""
    dt = jnp_dtype(cfg)
    k_emb, k_layers, k_head = jax.random.split(key, 3)
    x = jnp.zeros((1, 1, cfg.hidden_size), dt)
    pos = jnp.zeros((1, 1), jnp.int32)
    cache = jnp.zeros((1, 1, cfg.num_kv_heads, 1, cfg.head_dim), dt)
    lengths = jnp.zeros((1,), jnp.int32)
    layer = DecoderLayer(cfg.replace(attention_impl="reference"))

    def init_one(k):
        return layer.init(k, x, pos, cache, cache, 0, lengths, None)["params"]

    layers = jax.vmap(init_one)(jax.random.split(k_layers, cfg.num_layers))
    normal = lambda k, shape: (init_std * jax.random.normal(k, shape)).astype(dt)
    params = {
        "embed_tokens": {"embedding": normal(k_emb, (cfg.vocab_size, cfg.hidden_size))},
        "layers": layers,
        "norm": {"scale": jnp.ones((cfg.hidden_size,), dt)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": normal(k_head, (cfg.hidden_size, cfg.vocab_size))}
    return params


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return take(params["embed_tokens"]["embedding"], tokens)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, parents: jax.Array | None = None, active: jax.Array | None = None,
            prompt: bool = False) -> ForwardOutput:
    """Run the decoder over new tokens [B, T] at positions [B, T].

    parents None: causal over the cache prefix and the new tokens (prefill, decode).
    parents [B, T]: tree verification, each token sees the prefix and its ancestors.
    active [B, T] bool: the tokens whose outputs are needed (no active token may see an inactive
    one); the CPU kernels skip the others' matmuls and attention (their features and K/V are then
    meaningless), other paths compute them all.
    prompt: a prefill's forward. A bf16 model's Dense layers on the CPU kernels then sum their products
    with AVX-512 BF16 dot products where the CPU has them (`cpu_kernels.stacked_matmul`): another
    summation order than a decode step's or a verify's rows, which never take it, and the same for
    every method (all share the prefill).
    """
    return forward_embeddings(params, cfg, embed(params, tokens), positions, cache, parents, active, prompt)


def forward_embeddings(params: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array,
                       cache: KVCache, parents: jax.Array | None = None,
                       active: jax.Array | None = None, prompt: bool = False) -> ForwardOutput:
    """`forward` from input vectors x [B, T, d] instead of token ids (drafters feed features)."""
    layer = DecoderLayer(cfg)
    feature_layers = jnp.asarray(cfg.feature_layers, jnp.int32)
    b, t = x.shape[:2]
    # a bf16 model runs every forward on the kernels, prefill included: XLA's bf16 dots round differently
    # in each program (ar's, a method's), so a prompt's cache, and then the tokens, could differ by method
    # a causal forward (a prefill) runs them up to MAX_PREFILL_ROWS: faster than XLA's dots there too
    rows = cpu_kernels.MAX_ROWS if parents is not None else cpu_kernels.MAX_PREFILL_ROWS
    packed = params.get("packed_kernels") if b * t <= rows or cfg.dtype == "bfloat16" else None
    # with packed stacks the CPU kernels read this layer's weights and cache in place (no copies)
    ancestors = None
    if packed and cpu_kernels.attention_supported(cache.k.dtype, cfg.head_dim):
        ancestors = (jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)) if parents is None
                     else ancestor_mask(parents))
        if active is not None:   # an inactive query's row is empty: the attention kernel skips it
            ancestors = ancestors & active[:, :, None]

    def body(carry, inputs):
        x, ck, cv = carry
        p, idx = inputs
        kernel = (nn.intercept_methods(cpu_kernels.dense_interceptor(packed, idx, active, prompt)) if packed
                  else contextlib.nullcontext())
        with kernel:
            x, ck, cv = layer.apply({"params": p}, x, positions, ck, cv, idx, cache.lengths, parents, ancestors)
        return (x, ck, cv), (x if cfg.feature_layers else None)

    (x, ck, cv), per_layer = jax.lax.scan(
        body, (x, cache.k, cache.v), (params["layers"], jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    aux = per_layer[feature_layers] if cfg.feature_layers else jnp.zeros((0,) + x.shape, x.dtype)
    return ForwardOutput(x, aux, cache.replace(k=ck, v=cv))


def final_norm(params: dict, cfg: ModelConfig, features: jax.Array) -> jax.Array:
    if cfg.dtype == "bfloat16" and "packed_kernels" in params:   # the same bits at any row count
        return cpu_kernels.rms_norm(features, params["norm"]["scale"], cfg.rms_norm_eps)
    return rms_norm(features, params["norm"]["scale"], cfg.rms_norm_eps)


def lm_head_weight(params: dict, cfg: ModelConfig) -> jax.Array:
    """[d, V]: the LM head (the transposed embedding when tied)."""
    if cfg.tie_word_embeddings:
        return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]


def logits_from_features(params: dict, cfg: ModelConfig, features: jax.Array) -> jax.Array:
    """Next-token logits (f32) from pre-norm features [..., d]."""
    h = final_norm(params, cfg, features)
    return jnp.einsum("...d,dv->...v", h, lm_head_weight(params, cfg),
                      preferred_element_type=jnp.float32)


STREAM_HEAD_MAX_ROWS = 32


def streams_head_rows(cfg: ModelConfig, rows: int) -> bool:
    """Whether `serving_logits` runs the LM head over `rows` rows as one pass over the embedding.

    XLA:CPU computes one row as a streaming GEMV but 2+ rows as a GEMM that repacks the whole
    head (SmolLM2: 113 MB) on every call, 1.2-2x the one-row time at 2-16 rows. Written as a
    multiply and a reduction over d, XLA fuses it into one loop that reads each [d] embedding row
    once for all the rows: 20-30% cheaper at 2-32 rows (benchmarks/verify_cost.py) and f32-exact
    up to summation order. Only for a tied f32 head on the CPU at a verify-sized row count:
    accelerators, one row and training batches keep the dot."""
    return (1 < rows <= STREAM_HEAD_MAX_ROWS and cfg.tie_word_embeddings and cfg.dtype == "float32"
            and impl_backend(cfg.attention_impl) == "cpu")


def serving_logits(params: dict, cfg: ModelConfig, features: jax.Array) -> jax.Array:
    """`logits_from_features` in the form fastest for decoding and verification. Training keeps
    `logits_from_features`: backpropagating through the streamed form is neither measured nor tested."""
    lead = features.shape[:-1]
    head = params.get("packed_kernels", {}).get("head")
    if head is not None and math.prod(lead) <= cpu_kernels.MAX_ROWS:
        # a bf16 model's head on the CPU kernel (`api.serving_params`): its bf16 weights widened
        # exactly, f32 sums, as XLA's bf16 dot with f32 output computes them (up to summation order)
        rows = final_norm(params, cfg, features).reshape(-1, features.shape[-1])
        return cpu_kernels.stacked_matmul(rows, head, 0)[:, :cfg.vocab_size].reshape(*lead, cfg.vocab_size)
    if not streams_head_rows(cfg, math.prod(lead)):
        return logits_from_features(params, cfg, features)
    e = params["embed_tokens"]["embedding"]
    rows = final_norm(params, cfg, features).reshape(-1, features.shape[-1]).astype(jnp.float32)
    return jnp.sum(e[:, None, :] * rows[None], -1).T.reshape(*lead, e.shape[0])


class HeadScreen(NamedTuple):
    """A bf16 copy of a tied f32 LM head and the norms that bound its error, for `serving_argmax`:
    on the CPU kernels both packed once per target (`api.serving_params`), else built once per
    `generate` call (one pass over the embedding)."""
    weight: jax.Array       # [V, d] bf16(E), or its packed copy [1, V / 32, d, 32] for cpu_kernels
    norm: jax.Array         # [V] ||bf16(E_v)||
    err_norm: jax.Array     # [V] ||E_v - bf16(E_v)||


SCREEN_CANDIDATES = 16
# A bf16 x bf16 product is exact in f32, so the screen's error is the two roundings (bounded by the
# norms above, Cauchy-Schwarz) plus f32 accumulation over d terms; the certificate doubles that bound
# and adds 1e-3 so that a backend's blocked or fused accumulation (AVX-512 BF16's paired products, their
# denormals flushed, included) stays inside it.
SCREEN_SAFETY, SCREEN_SLACK = 2.0, 1e-3


# Above 16 rows the kernel's screen stops beating the streamed f32 head (benchmarks/verify_cost.py:
# 32 and 64 rows 8% slower): the products, top-k and candidates outgrow the bytes saved.
SCREEN_KERNEL_MAX_ROWS = 16


def head_screen(params: dict, cfg: ModelConfig, rows: int) -> HeadScreen | None:
    """The screen for a greedy step or verify over `rows` rows, or None where the f32 head is
    already the fastest form. With the CPU kernels' packed screen (`api.serving_params`) 1-16 rows,
    one row included: the kernel streams the bf16 head at memory speed, half the bytes of the f32
    GEMV. Else (and above 16 rows) 2-32 rows on the CPU as XLA's bf16 dot (`streams_head_rows`)."""
    packed = params.get("packed_kernels", {}).get("head_screen")
    kernel = packed is not None and rows <= SCREEN_KERNEL_MAX_ROWS
    if not (kernel or streams_head_rows(cfg, rows)):
        return None
    norms = params["packed_kernels"].get("head_screen_norms") if kernel else None
    if norms is not None:   # packed with the screen (`cpu_kernels.head_screen_norms`)
        return HeadScreen(packed, norms[0], norms[1])
    e = params["embed_tokens"]["embedding"].astype(jnp.float32)
    eb = e.astype(jnp.bfloat16)
    ebf = eb.astype(jnp.float32)
    return HeadScreen(packed if kernel else eb, jnp.sqrt(jnp.sum(ebf * ebf, -1)),
                      jnp.sqrt(jnp.sum(jnp.square(e - ebf), -1)))


SCREEN_BLOCK = 64   # the candidates' first stage: the best of every 64 tokens


def _screen_blocks(v: int, k: int) -> bool:
    """Whether a vocabulary of v tokens is screened by blocks for k candidates (whole blocks, enough of them)."""
    return v % SCREEN_BLOCK == 0 and v >= 4 * k * SCREEN_BLOCK


def screen_candidates(s: jax.Array, k: int) -> jax.Array:
    """The ids [n, k] of the k best scores of s [n, V]: the k blocks of SCREEN_BLOCK tokens with the best
    maxima hold them (a block outside them has k better tokens before its best), so top-k runs over the
    block maxima, then over those k blocks' tokens (8 rows of 49152: 0.59 -> 0.22 ms on 2 cores). Which
    candidates come out never changes an output (`screened_argmax` certifies or falls back), only how
    often a row is certified; ties go to either."""
    n, v = s.shape
    # The barriers keep XLA:CPU's top-k kernel: with its outputs sliced further it becomes a full sort
    # (15x slower). Only on the indices: a barrier on top-k's tuple crashes the SPMD partitioner.
    if not _screen_blocks(v, k):
        return jax.lax.optimization_barrier(jax.lax.top_k(s, k)[1])
    blocks = s.reshape(n, v // SCREEN_BLOCK, SCREEN_BLOCK)
    best = jax.lax.optimization_barrier(jax.lax.top_k(blocks.max(-1), k)[1])                # [n, k]
    inside = jnp.take_along_axis(blocks, best[:, :, None], axis=1).reshape(n, k * SCREEN_BLOCK)
    pick = jax.lax.optimization_barrier(jax.lax.top_k(inside, k)[1])
    return jnp.take_along_axis(best, pick // SCREEN_BLOCK, axis=1) * SCREEN_BLOCK + pick % SCREEN_BLOCK


class Screened(NamedTuple):
    """The screen's pass over rows [n, d] (`screen_rows`): what a certificate is checked from."""
    token: jax.Array    # int32 [n] the best exact candidate (lowest id among ties)
    best: jax.Array     # [n] its exact f32 logit
    s: jax.Array        # [n, V] the bf16 scores
    a: jax.Array        # [n, 1] the bound's coefficients: b_v = a * err_norm_v + c * norm_v + SCREEN_SLACK
    c: jax.Array        # [n, 1]
    cand: jax.Array     # int32 [n, k] the candidates


def screen_rows(params: dict, cfg: ModelConfig, features: jax.Array, screen: HeadScreen,
                candidates: int = SCREEN_CANDIDATES) -> Screened:
    """bf16 scores s over the whole vocabulary for features [n, d] (half the bytes of the f32 head, and
    XLA:CPU's bf16 GEMM does not repack), exact f32 logits for the top `candidates` of s, and the
    coefficients of a bound b_v >= |s_v - logit_v| from the stored norms."""
    d = features.shape[-1]
    h = final_norm(params, cfg, features).astype(jnp.float32)
    hb = h.astype(jnp.bfloat16)
    hbf = hb.astype(jnp.float32)
    if screen.weight.ndim == 2:
        s = jnp.einsum("nd,vd->nv", hb, screen.weight, preferred_element_type=jnp.float32)
    else:
        s = cpu_kernels.stacked_matmul(hbf, screen.weight, 0)[:, :screen.norm.shape[0]]
    cand = screen_candidates(s, candidates)
    gamma = d * 2.0 ** -24 / (1 - d * 2.0 ** -24)
    h_norm, hb_norm, h_err = (jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (h, hbf, h - hbf))
    a, c = SCREEN_SAFETY * h_norm, SCREEN_SAFETY * (h_err + gamma * hb_norm)
    exact = jnp.einsum("nd,nkd->nk", h, params["embed_tokens"]["embedding"][cand].astype(jnp.float32))
    best = jnp.max(exact, -1)
    token = jnp.min(jnp.where(exact == best[:, None], cand, s.shape[-1]), -1).astype(jnp.int32)
    return Screened(token, best, s, a, c, cand)


def screened_argmax(params: dict, cfg: ModelConfig, features: jax.Array, screen: HeadScreen,
                    candidates: int = SCREEN_CANDIDATES, per_token: bool = False) -> tuple[jax.Array, jax.Array]:
    """(token int32 [n], certified bool [n]) over features [n, d] from the bf16 screen (`screen_rows`).
    A row is certified when its best exact candidate beats s_v + b_v for every other token v: then
    it is the f32 argmax (ties among the candidates: lowest id, as `jnp.argmax`). The others'
    bound comes by blocks (`_others_bound`), or token by token with `per_token` (tighter, a pass
    over [n, V])."""
    r = screen_rows(params, cfg, features, screen, candidates)
    bound = (_token_bound if per_token else _others_bound)(r.s, r.a, r.c, screen, r.cand)
    return r.token, r.best > bound


def _token_bound(s, a, c, screen: HeadScreen, cand) -> jax.Array:
    """[n] max_v (s_v + b_v) over the tokens v not in `cand`, token by token."""
    rows = jnp.arange(s.shape[0])[:, None]
    bound = a * screen.err_norm + c * screen.norm + SCREEN_SLACK
    return (s + bound).at[rows, cand].set(-jnp.inf).max(-1)


def _others_bound(s, a, c, screen: HeadScreen, cand) -> jax.Array:
    """[n] an upper bound on max_v (s_v + b_v) over the tokens v not in `cand`. Per token over the
    blocks of SCREEN_BLOCK tokens that hold a candidate; over every other block from its maxima of
    s, err_norm and norm (a, c >= 0: the bound of each of its tokens is below), so one pass over
    [n, V / 64] instead of [n, V] (8 rows: ~0.15 ms of a 20 ms hsd round, Zen 4). Looser only where a
    block's own maxima come from different tokens."""
    n, v = s.shape
    rows = jnp.arange(n)[:, None]
    if not _screen_blocks(v, cand.shape[-1]):
        return _token_bound(s, a, c, screen, cand)
    nb = v // SCREEN_BLOCK
    blocks = s.reshape(n, nb, SCREEN_BLOCK)
    blk = cand // SCREEN_BLOCK                                                      # [n, k]
    ids = blk[:, :, None] * SCREEN_BLOCK + jnp.arange(SCREEN_BLOCK)                 # [n, k, 64]
    near = jnp.take_along_axis(blocks, blk[:, :, None], axis=1)
    near = near + a[:, :, None] * screen.err_norm[ids] + c[:, :, None] * screen.norm[ids] + SCREEN_SLACK
    is_cand = jnp.any(ids[..., None] == cand[:, None, None, :], -1)
    near = jnp.where(is_cand, -jnp.inf, near).max((1, 2))
    far = (blocks.max(-1) + a * screen.err_norm.reshape(nb, SCREEN_BLOCK).max(-1)
           + c * screen.norm.reshape(nb, SCREEN_BLOCK).max(-1) + SCREEN_SLACK)
    far = far.at[rows, blk].set(-jnp.inf).max(-1)
    return jnp.maximum(near, far)


def serving_argmax(params: dict, cfg: ModelConfig, features: jax.Array, screen: HeadScreen | None) -> jax.Array:
    """argmax of `serving_logits` over features [..., d] (int32 [...]) for greedy verification.
    With a screen, `screened_argmax`: if a row is not certified by the blocks' bound, by the
    token-by-token one (on 1,544 real MT-bench answer rows every row the blocks missed, 4, certified
    so, where each had cost the f32 head, 6-8 ms); if one still is not, the whole batch takes the
    f32 head (`lax.cond`). The result is the f32 argmax either way."""
    if screen is None:
        return argmax(serving_logits(params, cfg, features))
    r = screen_rows(params, cfg, features.reshape(-1, features.shape[-1]), screen)
    token = r.token.reshape(features.shape[:-1])
    f32_head = lambda: argmax(serving_logits(params, cfg, features))
    by_token = lambda: jax.lax.cond(jnp.all(r.best > _token_bound(r.s, r.a, r.c, screen, r.cand)),
                                    lambda: token, f32_head)
    return jax.lax.cond(jnp.all(r.best > _others_bound(r.s, r.a, r.c, screen, r.cand)), lambda: token, by_token)


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_logits(params, cfg, tokens, positions, cache, parents=None):
    """Jitted forward returning (logits [B, T, V], ForwardOutput); for tests and tools."""
    out = forward(params, cfg, tokens, positions, cache, parents)
    return logits_from_features(params, cfg, out.features), out


def prefill(params: dict, cfg: ModelConfig, tokens: jax.Array, prompt_lens: jax.Array, cache: KVCache):
    """Run right-padded prompts [B, T] through the model from an empty cache.

    Returns (logits at each prompt's last token [B, V], ForwardOutput with the cache
    committed to the prompt lengths)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    # the bucket's padding is inactive: the CPU kernels skip its rows (a 69-token prompt in the 128 bucket
    # cost 128 rows), its K/V land in scratch slots and its features are never read
    out = forward(params, cfg, tokens, positions, cache, active=positions < prompt_lens[:, None], prompt=True)
    logits = serving_logits(params, cfg, out.features[jnp.arange(b), prompt_lens - 1])
    return logits, out._replace(cache=out.cache.replace(lengths=prompt_lens.astype(jnp.int32)))


def cache_dtype(params: dict, cfg: ModelConfig):
    """The KV cache's dtype for serving `params`: the model's, except f32 for a bf16 model on the CPU
    kernels (`packed_kernels`). XLA:CPU has no bf16 scatter: each layer's cache write widened the whole
    [L, ...] bf16 stack to f32 and back (a bf16 decode step 105 ms against f32's 22 ms, SmolLM2, 512
    cached tokens), and as uint16 bits it still copies the stack. The K/V are bf16 values either way
    (the projections round to bf16), so an f32 cache holds them exactly: same outputs, twice the
    cache's bytes (~1 ms a step at 1536 cached tokens)."""
    return jnp.float32 if "packed_kernels" in params else jnp_dtype(cfg)


def prefill_new_cache(params: dict, cfg: ModelConfig, tokens: jax.Array, prompt_lens: jax.Array, capacity: int):
    """`prefill` into a new cache of `capacity` slots: the prompts [B, T] attend over T slots (the
    rest of an empty cache is never visible), so a prefill costs the same at any capacity."""
    b, t = tokens.shape
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, t, cfg.head_dim, cache_dtype(params, cfg))
    logits, out = prefill(params, cfg, tokens, prompt_lens, cache)
    return logits, out._replace(cache=widen(out.cache, capacity))
