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
    shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def write_layer(cache_arr: jax.Array, layer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write new [B, N, H_kv, D_h] entries of one layer at slots lengths[b] + i (out of range: dropped)."""
    b, n = new.shape[:2]
    slots = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    bidx = jnp.arange(b, dtype=jnp.int32)[:, None]
    return cache_arr.at[layer, bidx, :, slots].set(new.astype(cache_arr.dtype), mode="drop")


def advance(cache: KVCache, counts: jax.Array) -> KVCache:
    """Commit the first counts[b] written entries of every sequence."""
    return cache.replace(lengths=cache.lengths + counts.astype(jnp.int32))


def compact(cache: KVCache, src: jax.Array, counts: jax.Array) -> KVCache:
    """Move entries of chosen scratch slots to contiguous slots after the committed prefix.

    src: int32 [B, M] offsets relative to lengths[b] (slot lengths[b] + src[b, j] moves to
    lengths[b] + j) for j < counts[b]; later j are ignored. Offsets must be increasing, as an
    accepted tree path is (parents come before children). Lengths grow by counts.
    """
    b, m = src.shape
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    live = j < counts[:, None]
    src_slot = cache.lengths[:, None] + jnp.where(live, src, j)
    dst_slot = jnp.where(live, cache.lengths[:, None] + j, cache.capacity)
    bidx = jnp.arange(b, dtype=jnp.int32)[:, None]

    def move(arr):
        return arr.at[:, bidx, :, dst_slot].set(arr[:, bidx, :, src_slot], mode="drop")

    return KVCache(move(cache.k), move(cache.v), cache.lengths + counts.astype(jnp.int32))
