"""Tree attention for speculative-decoding verification, in Pallas and plain jnp.

Each sequence b has a committed KV prefix of length ``lengths[b]`` followed by
N new draft tokens whose K/V are already written at slots ``lengths[b] + i``.
New token i sees the whole prefix and the new tokens that are its ancestors
(or itself) in the draft tree given by ``parents``. N=1 is ordinary decode and
a chain ``parents = [-1, 0, ..., N-2]`` is causal prefill.

Implementations:

* ``tree_attention_reference``: plain jnp (XLA); the CPU path of the model.
* ``tree_attention_positional``: jnp, each row's keys gathered into position
  order, so a token's reductions do not depend on the tree's slot layout
  (exact mode: `generate(..., exact=N)`).
* ``tree_attention_pallas``: one online-softmax step function shared by two
  kernel variants. ``variant="tpu"`` is a Mosaic-style kernel with a grid over
  (batch, kv head, kv block), lengths as scalar prefetch (new values do not
  recompile) and fully-visible / boundary / skipped kv blocks. ``variant=
  "triton"`` is the GPU kernel: grid over (batch, kv head, row block) with a
  ``fori_loop`` over kv blocks up to ``lengths[b] + N``. Both run in interpret
  mode on CPU; ``interpret=None`` means interpret on CPU.

GQA: the G = Hq // Hkv query heads of one kv head are stacked into the rows of
one q block (row r = g * N + i), so K/V are never repeated in memory.

KV block size: the TPU variant takes the largest of 512/256/128 dividing S, else
one block of the full S (fine for small caches; pick S as a multiple of 128 for
large ones). The Triton variant takes the largest of 64/32/16 dividing S, else
zero-pads the cache to a multiple of 64 (a copy per call); a head size that is not a
power of two >= 16 (Qwen3's 48, 80...) is zero-padded the same way. The cache is never
padded on TPU. Slots >= lengths[b] + N may hold any garbage (NaN included for
the kernels); kv blocks entirely past lengths[b] + N are neither computed nor,
on TPU, fetched (the index map clamps to the last needed block).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
IMPLS = ("reference", "pallas", "pallas_tpu", "pallas_triton", "positional")
# The pinned variants: that kernel compiled (never interpreted) whatever the local backend, for
# programs lowered for a TPU or a GPU from another machine (`hsd compile`); the platform is in the
# impl's name so that JAX's trace caches (keyed on static arguments) never mix two platforms' programs.
PINNED = {"pallas_tpu": ("tpu", "tpu"), "pallas_triton": ("triton", "gpu")}
_TPU_BLOCK_KS = (512, 256, 128)
_TRITON_BLOCK_KS = (64, 32, 16)
_TRITON_MAX_ROWS = 64
_LANES = 128


def impl_backend(impl: str) -> str:
    """The backend a program with attention `impl` is built for: the pinned variant's platform
    ("tpu", "gpu"), else this process's default backend."""
    return PINNED[impl][1] if impl in PINNED else jax.default_backend()


def resolve_attention_impl(impl: str) -> str:
    """Map "auto" to "pallas" on tpu/gpu and "reference" on cpu; validate others."""
    if impl == "auto":
        return "reference" if jax.default_backend() == "cpu" else "pallas"
    if impl not in IMPLS:
        raise ValueError(
            f"unknown attention impl {impl!r}: expected one of 'auto', "
            + ", ".join(repr(i) for i in IMPLS))
    return impl


def _closure_steps(n: int) -> int:
    """Squarings of (I + A) needed to cover ancestor paths of length <= n - 1."""
    return max(n - 2, 0).bit_length()


def ancestor_mask(parents: jax.Array, max_depth: int | None = None) -> jax.Array:
    """Ancestor-or-self mask [B, N, N] (mask[b, i, a]) from parents [B, N].

    Gather-free: transitive closure of I + onehot(parent) by repeated squaring
    (matmul + compare): ceil(log2(max_depth)) steps when the tree depth is known,
    else ceil(log2(N - 1)).
    """
    n = parents.shape[-1]
    ids = jnp.arange(n, dtype=jnp.int32)
    reach = (parents.astype(jnp.int32)[..., :, None] == ids) | (ids[:, None] == ids)
    steps = _closure_steps(n) if max_depth is None else max(max_depth - 1, 0).bit_length()
    for _ in range(steps):
        r = reach.astype(jnp.float32)
        reach = jnp.einsum("...ij,...jk->...ik", r, r, precision=jax.lax.Precision.HIGHEST) > 0.5
    return reach


def _default_scale(sm_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def _visible_mask(lengths: jax.Array, parents: jax.Array, seq_len: int) -> jax.Array:
    """Bool [B, N, S]: prefix slots plus the ancestor mask placed at the new slots."""
    n = parents.shape[-1]
    col = jnp.arange(seq_len, dtype=jnp.int32)
    rel = col[None, :] - lengths[:, None]
    onehot = (rel[:, None, :] == jnp.arange(n, dtype=jnp.int32)[:, None]).astype(jnp.float32)
    anc = ancestor_mask(parents).astype(jnp.float32)
    tree = jnp.einsum("bia,bas->bis", anc, onehot) > 0.5
    return (col[None, None, :] < lengths[:, None, None]) | tree


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def tree_attention_reference(q, k_cache, v_cache, lengths, parents, sm_scale=None):
    """Plain-jnp tree attention with the kernel's semantics (see module doc).

    Garbage beyond lengths + N must be finite here (0 * inf in p @ V); the
    Pallas kernels also tolerate NaN/inf garbage.
    """
    b, hq, n, dh = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    lengths = lengths.astype(jnp.int32)
    scale = _default_scale(sm_scale, dh)
    qg = q.reshape(b, hkv, hq // hkv, n, dh)
    logits = jnp.einsum("bhgnd,bhsd->bhgns", qg, k_cache,
                        preferred_element_type=jnp.float32) * scale
    visible = _visible_mask(lengths, parents, s)[:, None, None]
    probs = jax.nn.softmax(jnp.where(visible, logits, MASK_VALUE), axis=-1)
    out = jnp.einsum("bhgns,bhsd->bhgnd", probs.astype(v_cache.dtype), v_cache,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, hq, n, dh).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def tree_attention_positional(q, k_cache, v_cache, lengths, parents, sm_scale=None):
    """Tree attention with each row's keys in position order: row i's ancestors (slots lengths +
    a_0 < ... < a_d, a_d = i) gathered to slots lengths + 0..d of a per-row copy of the cache, the
    prefix in place. Every row then reduces over the same positions with the same values whatever
    the tree's slot layout, as a 1-token decode step at the same row count does: what
    `generate(..., exact=N)` needs for a token's attention to match between ar and a tree verify
    (the reference's reductions group the path's keys by their slots). Costs a per-row copy of
    K/V ([B, Hkv, N, S, Dh]) and computes in f32; semantics otherwise the reference's."""
    b, hq, n, dh = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    lengths = lengths.astype(jnp.int32)
    anc = ancestor_mask(parents)                                        # [B, N, N]: row i, ancestor j
    rank = jnp.cumsum(anc.astype(jnp.int32), -1) - 1                    # j's place among i's ancestors
    depth = jnp.sum(anc, -1, dtype=jnp.int32) - 1                       # [B, N]
    nth = anc[:, :, None, :] & (rank[:, :, None, :] == jnp.arange(n, dtype=jnp.int32)[:, None])
    idx = jnp.sum(jnp.where(nth, jnp.arange(n, dtype=jnp.int32), 0), -1)   # [B, N, k]: i's k-th ancestor
    col = jnp.arange(s, dtype=jnp.int32)
    rel = jnp.broadcast_to(col[None, None, :] - lengths[:, None, None], (b, n, s))
    window = (rel >= 0) & (rel < n)
    src = jnp.where(window, lengths[:, None, None] + jnp.take_along_axis(idx, jnp.clip(rel, 0, n - 1), -1), col)
    visible = col[None, None, :] <= lengths[:, None, None] + depth[:, :, None]   # [B, N, S]
    gather = jax.vmap(lambda c, i: c[:, i].astype(jnp.float32))          # [Hkv, S, Dh], [N, S] -> [Hkv, N, S, Dh]
    k_rows, v_rows = gather(k_cache, src), gather(v_cache, src)
    qg = q.reshape(b, hkv, hq // hkv, n, dh).astype(jnp.float32)   # f32 throughout (XLA:CPU has no bf16 batched dot)
    logits = jnp.einsum("bhgnd,bhnsd->bhgns", qg, k_rows) * _default_scale(sm_scale, dh)
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], logits, MASK_VALUE), axis=-1)
    out = jnp.einsum("bhgns,bhnsd->bhgnd", probs, v_rows)
    return out.reshape(b, hq, n, dh).astype(q.dtype)


def _online_softmax_step(q, k, v, anc, start, length, n_new, m_prev, l_prev, acc_prev,
                         *, sm_scale, masked):
    """One flash-attention update of (m, l, acc) with kv block [start, start + bk).

    q [R, Dh]; k, v [bk, Dh]; anc f32 [R, A] (row r's ancestor-or-self set over
    the A >= N new tokens); m, l [R, 1]; acc [R, Dh]. With ``masked`` the block
    may hold slots >= length: slot j is visible to row r iff j < length or
    anc[r, j - length]; the shift is a one-hot matmul (no gather). Columns at
    or past length + n_new get p = 0 and V rows zeroed, so NaN garbage is inert.
    """
    rows, bk = q.shape[0], k.shape[0]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * sm_scale
    if masked:
        n_anc = anc.shape[1]
        rel = lax.broadcasted_iota(jnp.int32, (n_anc, bk), 1) + (start - length)
        onehot = (rel == lax.broadcasted_iota(jnp.int32, (n_anc, bk), 0)).astype(jnp.float32)
        tree = lax.dot_general(anc, onehot, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32) > 0.5
        col = lax.broadcasted_iota(jnp.int32, (rows, bk), 1) + start
        visible = (col < length) | tree
        s = jnp.where(visible, s, MASK_VALUE)
        v_col = lax.broadcasted_iota(jnp.int32, v.shape, 0) + start
        v = jnp.where(v_col < length + n_new, v, jnp.zeros_like(v))
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    if masked:
        p = jnp.where(visible, p, 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv


def _normalize(acc, l):
    """acc / l, with 0 for rows that saw nothing (only padding rows can)."""
    return acc / jnp.where(l == 0.0, 1.0, l)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _pack_rows(q, anc, hkv, rows, n_anc):
    """Group query heads by kv head: q -> [B, Hkv, rows, Dh], anc -> int32 [B, rows, n_anc].

    Row r = g * N + i; rows past G * N are zero padding.
    """
    b, hq, n, dh = q.shape
    gn = (hq // hkv) * n
    qr = q.reshape(b, hkv, gn, dh)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - gn), (0, 0)))
    ar = jnp.tile(anc.astype(jnp.int32), (1, hq // hkv, 1))
    ar = jnp.pad(ar, ((0, 0), (0, rows - gn), (0, n_anc - n)))
    return qr, ar


def _unpack_rows(out, hq, n):
    b, hkv, _, dh = out.shape
    return out[:, :, : (hq // hkv) * n].reshape(b, hq, n, dh)


def _tpu_block_k(seq_len: int, block_k: int | None) -> int:
    """Largest of 512/256/128 dividing S, else the full S (TPU tiling rules)."""
    if block_k is not None:
        if seq_len % block_k:
            raise ValueError(f"block_k={block_k} must divide the cache length S={seq_len}")
        return block_k
    return next((bk for bk in _TPU_BLOCK_KS if seq_len % bk == 0), seq_len)


def _tpu_matmul_dtype(dtype, interpret: bool):
    """The dtype the TPU kernel's q/k/v matmuls take: bf16 stays bf16 where Mosaic multiplies it
    (TPU v4 and later), else f32: on v2/v3 Mosaic refuses a bf16 matmul ("Unsupported matmul RHS
    type on target", found by `hsd compile --tpu v3:2x2`), so the kernel widens its VMEM blocks."""
    if interpret or dtype != jnp.bfloat16:
        return dtype
    try:
        generation = pltpu.get_tpu_info().generation   # the chip being lowered for (device or mesh)
    except ValueError:   # not lowering for a known TPU chip
        return dtype
    return dtype if generation >= 4 else jnp.float32


def _tpu_kernel(lengths_ref, q_ref, k_ref, v_ref, anc_ref, o_ref, m_ref, l_ref, acc_ref,
                *, sm_scale, block_k, n_new, matmul_dtype):
    """Grid step (b, kv head, kv block). m/l scratch is lane-replicated [R, 128]."""
    kv_i = pl.program_id(2)
    length = lengths_ref[pl.program_id(0)]
    start = kv_i * block_k

    @pl.when(kv_i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked):
        m_prev = jnp.max(m_ref[...], axis=1, keepdims=True)
        l_prev = jnp.max(l_ref[...], axis=1, keepdims=True)
        q, k, v = (r[...].astype(matmul_dtype) for r in (q_ref, k_ref, v_ref))
        m, l, acc = _online_softmax_step(
            q, k, v, anc_ref[...].astype(jnp.float32),
            start, length, n_new, m_prev, l_prev, acc_ref[...],
            sm_scale=sm_scale, masked=masked)
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
        acc_ref[...] = acc

    pl.when(start + block_k <= length)(lambda: step(False))
    pl.when((start + block_k > length) & (start < length + n_new))(lambda: step(True))

    @pl.when(kv_i == pl.num_programs(2) - 1)
    def _finish():
        l = jnp.max(l_ref[...], axis=1, keepdims=True)
        o_ref[...] = _normalize(acc_ref[...], l).astype(o_ref.dtype)


def _tree_attention_tpu(q, k_cache, v_cache, lengths, anc, *, sm_scale, block_k, interpret):
    b, hq, n, dh = q.shape
    _, hkv, s, _ = k_cache.shape
    bk = _tpu_block_k(s, block_k)
    rows = _round_up((hq // hkv) * n, 8)
    qr, ar = _pack_rows(q, anc, hkv, rows, _round_up(n, _LANES))

    def kv_map(bi, hi, ki, lens):
        return bi, hi, jnp.minimum(ki, (lens[bi] + n - 1) // bk), 0

    q_spec = pl.BlockSpec((None, None, rows, dh), lambda bi, hi, ki, lens: (bi, hi, 0, 0))
    kv_spec = pl.BlockSpec((None, None, bk, dh), kv_map)
    anc_spec = pl.BlockSpec((None, rows, ar.shape[-1]), lambda bi, hi, ki, lens: (bi, 0, 0))
    kernel = functools.partial(_tpu_kernel, sm_scale=sm_scale, block_k=bk, n_new=n,
                               matmul_dtype=_tpu_matmul_dtype(q.dtype, interpret))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, s // bk),
            in_specs=[q_spec, kv_spec, kv_spec, anc_spec],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((rows, _LANES), jnp.float32),
                            pltpu.VMEM((rows, _LANES), jnp.float32),
                            pltpu.VMEM((rows, dh), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(lengths, qr, k_cache, v_cache, ar)
    return _unpack_rows(out, hq, n)


def _triton_block_k(seq_len: int, block_k: int | None) -> int:
    """Largest of 64/32/16 dividing S, else 64 (the caller then pads S)."""
    if block_k is not None:
        if seq_len % block_k or block_k != _next_pow2(block_k) or block_k < 16:
            raise ValueError(f"block_k={block_k} must divide the cache length S={seq_len} "
                             "and be a power of two >= 16 for triton")
        return block_k
    return next((c for c in _TRITON_BLOCK_KS if seq_len % c == 0), _TRITON_BLOCK_KS[0])


def _triton_kernel(lengths_ref, q_ref, k_ref, v_ref, anc_ref, o_ref, *, sm_scale, block_k, n_new):
    """Grid step (b, kv head, row block): loop over kv blocks below length + N."""
    length = lengths_ref[...]
    q = q_ref[...]
    anc = anc_ref[...].astype(jnp.float32)
    rows, dh = q.shape

    def body(masked):
        def update(i, carry):
            start = pl.multiple_of(i * block_k, block_k)
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
            return _online_softmax_step(q, k, v, anc, start, length, n_new, *carry,
                                        sm_scale=sm_scale, masked=masked)
        return update

    carry = (jnp.full((rows, 1), MASK_VALUE, jnp.float32),
             jnp.zeros((rows, 1), jnp.float32),
             jnp.zeros((rows, dh), jnp.float32))
    n_full = length // block_k
    carry = lax.fori_loop(0, n_full, body(False), carry)
    carry = lax.fori_loop(n_full, pl.cdiv(length + n_new, block_k), body(True), carry)
    _, l, acc = carry
    o_ref[...] = _normalize(acc, l).astype(o_ref.dtype)


def _tree_attention_triton(q, k_cache, v_cache, lengths, anc, *, sm_scale, block_k, interpret):
    """GPU variant. Triton needs power-of-two tiles >= 16: rows and the ancestor
    width are padded, S may be padded (see module doc), and so is Dh (Qwen3-style head sizes
    such as 48 or 80): zero lanes add nothing to a score and are dropped from the output."""
    b, hq, n, dh = q.shape
    _, hkv, s, _ = k_cache.shape
    lanes = max(_next_pow2(dh), 16)
    if dh != lanes:
        pad = ((0, 0),) * 3 + ((0, lanes - dh),)
        out = _tree_attention_triton(jnp.pad(q, pad), jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), lengths, anc,
                                     sm_scale=sm_scale, block_k=block_k, interpret=interpret)
        return out[..., :dh]
    bk = _triton_block_k(s, block_k)
    if s % bk:
        pad = ((0, 0), (0, 0), (0, _round_up(s, bk) - s), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    rows = max(_next_pow2((hq // hkv) * n), 16)
    block_r = min(rows, _TRITON_MAX_ROWS)
    qr, ar = _pack_rows(q, anc, hkv, rows, max(_next_pow2(n), 16))
    seq = k_cache.shape[2]

    q_spec = pl.BlockSpec((None, None, block_r, dh), lambda bi, hi, ri: (bi, hi, ri, 0))
    kv_spec = pl.BlockSpec((None, None, seq, dh), lambda bi, hi, ri: (bi, hi, 0, 0))
    anc_spec = pl.BlockSpec((None, block_r, ar.shape[-1]), lambda bi, hi, ri: (bi, ri, 0))
    len_spec = pl.BlockSpec((None,), lambda bi, hi, ri: (bi,))
    kernel = functools.partial(_triton_kernel, sm_scale=sm_scale, block_k=bk, n_new=n)
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, rows // block_r),
        in_specs=[len_spec, q_spec, kv_spec, kv_spec, anc_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(lengths, qr, k_cache, v_cache, ar)
    return _unpack_rows(out, hq, n)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "variant"))
def tree_attention_pallas(q, k_cache, v_cache, lengths, parents, *, sm_scale=None,
                          block_k=None, interpret=None, variant=None):
    """Pallas tree attention. ``variant``: "tpu" (Mosaic) or "triton" (GPU);
    None picks "triton" on gpu and "tpu" elsewhere (interpret on CPU)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if variant is None:
        variant = "triton" if jax.default_backend() == "gpu" else "tpu"
    if variant not in ("tpu", "triton"):
        raise ValueError(f"unknown pallas variant {variant!r}: expected 'tpu' or 'triton'")
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    impl = _tree_attention_tpu if variant == "tpu" else _tree_attention_triton
    return impl(q, k_cache, v_cache, lengths.astype(jnp.int32), ancestor_mask(parents),
                sm_scale=_default_scale(sm_scale, q.shape[-1]), block_k=block_k,
                interpret=interpret)


def tree_attention(q, k_cache, v_cache, lengths, parents, *, sm_scale=None,
                   impl="reference", block_k=None, interpret=None):
    """Tree attention over a static KV cache; dispatches on ``impl``.

    q [B, Hq, N, Dh]; k_cache, v_cache [B, Hkv, S, Dh] with the N new tokens
    already written at slots lengths[b] + i (lengths[b] + N <= S); lengths
    int32 [B]; parents int32 [B, N] (parent index among the new tokens, -1 for
    a root, parents[b, i] < i). Returns [B, Hq, N, Dh] in q's dtype.
    impl: "reference" | "pallas" | "auto" (see ``resolve_attention_impl``) | "pallas_tpu" |
    "pallas_triton" (``PINNED``) | "positional" (``tree_attention_positional``). Under a
    ``data``/``model`` mesh the Pallas kernel runs per shard (``_per_shard``).
    """
    impl = resolve_attention_impl(impl)
    if impl == "reference":
        return tree_attention_reference(q, k_cache, v_cache, lengths, parents, sm_scale=sm_scale)
    if impl == "positional":
        return tree_attention_positional(q, k_cache, v_cache, lengths, parents, sm_scale=sm_scale)
    variant = None
    if impl in PINNED:
        variant, interpret = PINNED[impl][0], False
    kernel = functools.partial(tree_attention_pallas, sm_scale=sm_scale, block_k=block_k, interpret=interpret,
                               variant=variant)
    return _per_shard(kernel, q, k_cache, v_cache, lengths, parents)


def _per_shard(kernel, q, k_cache, v_cache, lengths, parents):
    """Run ``kernel`` once per shard when traced under a mesh (``jax.set_mesh``) with a ``data``
    (batch) and/or ``model`` (heads) axis: a pallas_call has no partitioning rule, so XLA would
    otherwise gather the whole cache onto every device. Batch must divide by ``data`` and
    both head counts by ``model``; contiguous head blocks keep each GQA group on one shard."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    batch_ax = "data" if sizes.get("data", 1) > 1 else None
    head_ax = "model" if sizes.get("model", 1) > 1 else None
    if batch_ax is None and head_ax is None:
        return kernel(q, k_cache, v_cache, lengths, parents)
    heads, per_seq = jax.sharding.PartitionSpec(batch_ax, head_ax), jax.sharding.PartitionSpec(batch_ax)
    return jax.shard_map(kernel, in_specs=(heads, heads, heads, per_seq, per_seq), out_specs=heads,
                         check_vma=False)(q, k_cache, v_cache, lengths, parents)
