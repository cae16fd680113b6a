"""Fixed-capacity KV cache with per-sequence lengths, and pure update functions.

Layout: k, v are [L, B, H_kv, S, D_h]; `lengths[b]` counts the committed entries of
sequence b. A forward writes its N new entries at slots lengths[b] .. lengths[b]+N-1
without committing them; the caller then commits a prefix (`advance`) or an
accepted tree path (`compact`). Entries at slots >= lengths are scratch.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from hsd_jax.sharding import constrain_cache


@flax.struct.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def init_cache(num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
               dtype=jnp.float32) -> KVCache:
    """An empty cache; under a mesh (`jax.set_mesh`) pinned to batch over `data`, KV heads over `model`."""
    shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
    return constrain_cache(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32)))


def widen(cache: KVCache, capacity: int) -> KVCache:
    """The same cache with its slot axis padded (empty slots) to `capacity`."""
    pad = ((0, 0),) * 3 + ((0, capacity - cache.capacity), (0, 0))
    return constrain_cache(cache.replace(k=jnp.pad(cache.k, pad), v=jnp.pad(cache.v, pad)))


def write_layer(cache_arr: jax.Array, layer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write new [B, N, H_kv, D_h] entries of one layer at slots lengths[b] + i (out of range: dropped).

    One sequence: one contiguous slab (`_write_slab`). Several: one scatter with the batch as an
    explicit batching dimension, so XLA's partitioner keeps it local to each `data` shard (a plain
    fancy-index scatter would all-gather the updates).
    """
    b, n = new.shape[:2]
    if b == 1 and n <= cache_arr.shape[3]:
        return _write_slab(cache_arr, layer, new, lengths[0])
    slots = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (b, n)), slots], -1)
    dims = lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 3),
                                       scatter_dims_to_operand_dims=(0, 3), operand_batching_dims=(1,),
                                       scatter_indices_batching_dims=(0,))
    return lax.scatter(cache_arr, idx, new.astype(cache_arr.dtype), dims, indices_are_sorted=True,
                       unique_indices=True, mode=lax.GatherScatterMode.FILL_OR_DROP)


def _write_slab(cache_arr: jax.Array, layer: jax.Array, new: jax.Array, length: jax.Array) -> jax.Array:
    """`write_layer` for one sequence as one dynamic_update_slice of its N slots: XLA:CPU runs a
    scatter as a loop over its rows (a 3/2/2 + 4 lookup verify: 240 iterations, ~2.5 ms of a
    ~30 ms round). A write past the capacity starts at S - N instead (dynamic_update_slice
    clamps) and keeps the entries already in the slots before `length`: those rows are dropped."""
    n, s = new.shape[1], cache_arr.shape[3]
    length = jnp.asarray(length, jnp.int32)
    start = jnp.clip(length, 0, s - n)
    rows = new[0].transpose(1, 0, 2).astype(cache_arr.dtype)[None, None]          # [1, 1, H, N, D]
    at = (jnp.asarray(layer, jnp.int32), 0, 0, start, 0)
    shift = length - start                                                         # > 0 only past the capacity
    r = jnp.arange(n, dtype=jnp.int32)
    old = lax.dynamic_slice(cache_arr, at, rows.shape)
    moved = jnp.take(rows, jnp.clip(r - shift, 0, n - 1), axis=3)
    rows = jnp.where((r >= shift)[:, None], moved, old)
    return lax.dynamic_update_slice(cache_arr, rows, at)


def advance(cache: KVCache, counts: jax.Array) -> KVCache:
    """Commit the first counts[b] written entries of every sequence."""
    return cache.replace(lengths=cache.lengths + counts.astype(jnp.int32))


_SLOT_GATHER = lax.GatherDimensionNumbers(offset_dims=(2, 3, 4), collapsed_slice_dims=(3,), start_index_map=(3,),
                                          operand_batching_dims=(1,), start_indices_batching_dims=(0,))
_SLOT_SCATTER = lax.ScatterDimensionNumbers(update_window_dims=(2, 3, 4), inserted_window_dims=(3,),
                                            scatter_dims_to_operand_dims=(3,), operand_batching_dims=(1,),
                                            scatter_indices_batching_dims=(0,))


def _gather_slots(arr: jax.Array, slots: jax.Array) -> jax.Array:
    """Entries [B, M, L, H, D] of a cache array [L, B, H, S, D] at slots [B, M] (clipped)."""
    l, _, h, _, d = arr.shape
    return lax.gather(arr, slots[..., None], _SLOT_GATHER, (l, 1, h, 1, d), mode=lax.GatherScatterMode.CLIP)


def _scatter_slots(arr: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """`arr` with rows [B, M, L, H, D] written at slots [B, M] (out of range: dropped)."""
    return lax.scatter(arr, slots[..., None], rows, _SLOT_SCATTER, mode=lax.GatherScatterMode.FILL_OR_DROP)


def compact(cache: KVCache, src: jax.Array, counts: jax.Array) -> KVCache:
    """Move entries of chosen scratch slots to contiguous slots after the committed prefix.

    src: int32 [B, M] offsets relative to lengths[b] (slot lengths[b] + src[b, j] moves to
    lengths[b] + j) for j < counts[b]; later j are ignored. Offsets must be increasing, as an
    accepted tree path is (parents come before children). Lengths grow by counts.
    """
    m = src.shape[1]
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    live = j < counts[:, None]
    src_slot = cache.lengths[:, None] + jnp.where(live, src, j)
    dst_slot = jnp.where(live, cache.lengths[:, None] + j, cache.capacity)

    def move(arr):  # batched gather + scatter: stays local to each `data` shard, as in write_layer
        return _scatter_slots(arr, dst_slot, _gather_slots(arr, src_slot))

    return KVCache(move(cache.k), move(cache.v), cache.lengths + counts.astype(jnp.int32))


def take_slots(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...] gathered along T at idx [B, M] (negative -> slot 0)."""
    idx = jnp.maximum(idx, 0)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def restore_slots(new: KVCache, old: KVCache, start: jax.Array, stop: jax.Array) -> KVCache:
    """`new` with `old`'s entries at slots start[b] <= s < stop[b]: undoes scratch writes there."""
    s = jnp.arange(new.capacity, dtype=jnp.int32)[None]
    keep = ((s >= start[:, None]) & (s < stop[:, None]))[None, :, None, :, None]
    return new.replace(k=jnp.where(keep, old.k, new.k), v=jnp.where(keep, old.v, new.v))


def restore_at(new: KVCache, old: KVCache, slots: jax.Array, keep: jax.Array) -> KVCache:
    """`new` with `old`'s entries at slots[b, j] where keep[b, j]: `restore_slots` for a few known
    slots, one gather and scatter instead of a pass over the whole capacity."""
    dst = jnp.where(keep, slots, new.capacity)
    return new.replace(k=_scatter_slots(new.k, dst, _gather_slots(old.k, slots)),
                       v=_scatter_slots(new.v, dst, _gather_slots(old.v, slots)))


def at_offset(cache: KVCache, offset) -> KVCache:
    """The same cache with writes aimed `offset` slots past the committed length."""
    return cache.replace(lengths=cache.lengths + offset)
