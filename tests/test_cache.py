"""KV cache: per-sequence writes, commits and compaction of accepted tree paths."""
import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.cache import advance, compact, init_cache, restore_slots, write_layer


def _filled(b=2, s=12, layers=2, h=1, d=1):
    c = init_cache(layers, b, h, s, d)
    vals = jnp.arange(layers * b * h * s * d, dtype=jnp.float32).reshape(c.k.shape)
    return c.replace(k=vals, v=-vals)


def test_write_layer_uses_each_sequence_length():
    c = init_cache(2, 2, 1, 8, 1).replace(lengths=jnp.array([1, 5], jnp.int32))
    new = jnp.array([[7.0, 8.0], [9.0, 10.0]])[:, :, None, None]
    k = write_layer(c.k, 1, new, c.lengths)
    assert k[1, 0, 0, 1:3, 0].tolist() == [7.0, 8.0]
    assert k[1, 1, 0, 5:7, 0].tolist() == [9.0, 10.0]
    assert float(jnp.abs(k[0]).sum()) == 0.0
    assert float(jnp.abs(k[1]).sum()) == 34.0


def test_write_past_capacity_is_dropped_not_clamped():
    c = init_cache(1, 1, 1, 4, 1).replace(lengths=jnp.array([3], jnp.int32))
    new = jnp.array([[1.0, 2.0]])[:, :, None, None]
    k = write_layer(c.k, 0, new, c.lengths)
    assert k[0, 0, 0, :, 0].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_one_sequence_writes_as_a_slab_what_the_batched_scatter_writes():
    """Batch 1 writes one dynamic_update_slice, batch 2 a scatter: sequence 0 of a batch-2 write equals the
    batch-1 write at every length, a write past the capacity included (its rows dropped, earlier slots kept)."""
    rng = np.random.default_rng(0)
    for s, n in ((8, 1), (8, 3), (16, 8), (8, 8)):
        arr = jnp.asarray(rng.standard_normal((2, 2, 3, s, 4)), jnp.float32)
        new = jnp.asarray(rng.standard_normal((2, n, 3, 4)), jnp.float32)
        for length in range(s + 2):
            for layer in (0, 1):
                one = jax.jit(write_layer)(arr[:, :1], layer, new[:1], jnp.asarray([length], jnp.int32))
                two = jax.jit(write_layer)(arr, layer, new, jnp.asarray([length, 2], jnp.int32))
                np.testing.assert_array_equal(np.asarray(one), np.asarray(two)[:, :1])
    hlo = jax.jit(write_layer).lower(arr[:, :1], 0, new[:1], jnp.asarray([3], jnp.int32)).as_text()
    assert "dynamic_update_slice" in hlo and "scatter" not in hlo


def test_advance_commits_counts():
    c = advance(init_cache(1, 3, 1, 8, 1), jnp.array([0, 2, 5]))
    assert c.lengths.tolist() == [0, 2, 5]


def test_compact_moves_accepted_path_after_prefix():
    c = _filled().replace(lengths=jnp.array([2, 4], jnp.int32))
    before = np.asarray(c.k)
    src = jnp.array([[0, 2, 5, 0], [0, 1, 3, 6]], jnp.int32)
    counts = jnp.array([3, 4], jnp.int32)
    out = jax.jit(compact)(c, src, counts)
    assert out.lengths.tolist() == [5, 8]
    k = np.asarray(out.k)
    for b, (base, n) in enumerate([(2, 3), (4, 4)]):
        for j in range(n):
            np.testing.assert_array_equal(k[:, b, :, base + j], before[:, b, :, base + int(src[b, j])])
        np.testing.assert_array_equal(k[:, b, :, :base], before[:, b, :, :base])
    np.testing.assert_array_equal(np.asarray(out.v), -k)


def test_compact_with_zero_count_changes_nothing():
    c = _filled().replace(lengths=jnp.array([3, 0], jnp.int32))
    out = compact(c, jnp.array([[4, 5], [1, 2]], jnp.int32), jnp.array([0, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.k), np.asarray(c.k))
    assert out.lengths.tolist() == [3, 0]


def test_restore_slots_undoes_writes_only_inside_each_sequences_range():
    old = _filled(b=2, s=12)
    new = old.replace(k=old.k * 0 + 100.0, v=old.v * 0 + 100.0)
    out = restore_slots(new, old, jnp.array([2, 5]), jnp.array([4, 12]))
    kept = np.zeros((2, 12), bool)
    kept[0, 2:4] = kept[1, 5:] = True
    for a, o in ((out.k, old.k), (out.v, old.v)):
        a, o = (np.moveaxis(np.asarray(x), (1, 3), (0, 1)) for x in (a, o))   # [B, S, L, H, D]
        assert np.array_equal(a[kept], o[kept])
        assert np.all(a[~kept] == 100.0)
