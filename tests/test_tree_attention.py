"""Tree attention: reference vs brute force, Pallas kernels (interpret mode) vs reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import (
    ancestor_mask,
    resolve_attention_impl,
    tree_attention,
    tree_attention_pallas,
    tree_attention_reference,
)

GARBAGE = 1e4


def random_parents(rng, batch, n, kind):
    """Chains, or random trees (parent uniform in [-1, i))."""
    if kind == "chain":
        return np.tile(np.arange(-1, n - 1, dtype=np.int32), (batch, 1))
    return np.stack([[rng.integers(-1, i) if i else -1 for i in range(n)]
                     for _ in range(batch)]).astype(np.int32)


def make_inputs(rng, *, n, s, g, dh, kind, dtype, hkv, lengths, garbage=GARBAGE):
    """Random q/k/v with large finite garbage at slots >= lengths + n."""
    batch = len(lengths)
    q = rng.standard_normal((batch, hkv * g, n, dh))
    k = rng.standard_normal((batch, hkv, s, dh))
    v = rng.standard_normal((batch, hkv, s, dh))
    for b, length in enumerate(lengths):
        k[b, :, length + n:] = garbage * rng.standard_normal(k[b, :, length + n:].shape)
        v[b, :, length + n:] = garbage * rng.standard_normal(v[b, :, length + n:].shape)
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(random_parents(rng, batch, n, kind)))


def brute_force(q, k, v, lengths, parents):
    """Float64 loop over (b, h, i) with explicit visible slot lists."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, hq, n, dh = q.shape
    group = hq // k.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        length = int(lengths[b])
        for i in range(n):
            slots, a = list(range(length)), i
            while a >= 0:
                slots.append(length + a)
                a = int(parents[b, a])
            for h in range(hq):
                logits = k[b, h // group, slots] @ q[b, h, i] / np.sqrt(dh)
                p = np.exp(logits - logits.max())
                out[b, h, i] = (p / p.sum()) @ v[b, h // group, slots]
    return out


def naive_ancestors(parents):
    batch, n = parents.shape
    mask = np.zeros((batch, n, n), bool)
    for b in range(batch):
        for i in range(n):
            a = i
            while a >= 0:
                mask[b, i, a] = True
                a = parents[b, a]
    return mask


def max_abs_diff(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# (n, s, g, dh, tree kind, dtype); lengths are [0, mid, s - n].
KERNEL_CASES = [
    (1, 200, 1, 64, "chain", jnp.float32),
    (5, 200, 3, 64, "random", jnp.float32),
    (16, 256, 9, 64, "random", jnp.float32),
    (16, 200, 3, 128, "chain", jnp.float32),
    (5, 384, 9, 128, "random", jnp.float32),
    (1, 256, 3, 128, "chain", jnp.bfloat16),
    (16, 256, 3, 64, "random", jnp.bfloat16),
    (5, 200, 1, 128, "random", jnp.bfloat16),
    (5, 200, 3, 48, "random", jnp.float32),      # a head size that is not a power of two (Qwen3-style)
]


def case_lengths(n, s):
    return [0, min(130, s - n), s - n]


@pytest.mark.parametrize("variant", ["tpu", "triton"])
@pytest.mark.parametrize("n,s,g,dh,kind,dtype", KERNEL_CASES)
def test_kernel_matches_reference(variant, n, s, g, dh, kind, dtype):
    """Kernel (and, for bf16, the bf16 reference) vs the f32 reference on the same values."""
    rng = np.random.default_rng(n * 1000 + s + g + dh)
    hkv = 1 if g == 9 else 2
    args = make_inputs(rng, n=n, s=s, g=g, dh=dh, kind=kind, dtype=dtype, hkv=hkv,
                       lengths=case_lengths(n, s))
    native = {"gpu": "triton", "tpu": "tpu"}.get(jax.default_backend())
    out = tree_attention_pallas(*args, variant=variant,
                                interpret=None if variant == native else True)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    exact = tree_attention_reference(*(a.astype(jnp.float32) if a.dtype == dtype else a
                                       for a in args))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert max_abs_diff(out, exact) <= tol
    assert max_abs_diff(tree_attention_reference(*args), exact) <= tol


@pytest.mark.parametrize("n,kind", [(1, "chain"), (5, "random"), (7, "chain")])
def test_reference_matches_brute_force(n, kind):
    rng = np.random.default_rng(n)
    args = make_inputs(rng, n=n, s=40, g=3, dh=16, kind=kind, dtype=jnp.float32, hkv=2,
                       lengths=[0, 9, 40 - n], garbage=1.0)
    ref = tree_attention_reference(*args)
    expected = brute_force(*args)
    np.testing.assert_allclose(np.asarray(ref), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_garbage_beyond_new_tokens_is_ignored(impl):
    rng = np.random.default_rng(7)
    q, k, v, lengths, parents = make_inputs(rng, n=5, s=256, g=3, dh=64, kind="random",
                                            dtype=jnp.float32, hkv=2, lengths=[0, 128, 200])
    beyond = (jnp.arange(256)[None, :] >= lengths[:, None] + 5)[:, None, :, None]
    other = jnp.asarray(GARBAGE * rng.standard_normal(k.shape), jnp.float32)
    run = lambda kk, vv: tree_attention(q, kk, vv, lengths, parents, impl=impl)
    base = run(k, v)
    changed = run(jnp.where(beyond, other, k), jnp.where(beyond, -other, v))
    np.testing.assert_array_equal(np.asarray(base), np.asarray(changed))
    if impl == "pallas":
        nan_k, nan_v = jnp.where(beyond, jnp.nan, k), jnp.where(beyond, jnp.inf, v)
        np.testing.assert_array_equal(np.asarray(base), np.asarray(run(nan_k, nan_v)))


def test_new_lengths_do_not_retrace():
    traces = []

    @jax.jit
    def step(q, k, v, lengths, parents):
        traces.append(1)
        return tree_attention(q, k, v, lengths, parents, impl="pallas")

    rng = np.random.default_rng(3)
    q, k, v, _, parents = make_inputs(rng, n=5, s=200, g=1, dh=64, kind="random",
                                      dtype=jnp.float32, hkv=2, lengths=[0, 0, 0])
    for lengths in ([0, 17, 195], [100, 3, 60], [195, 195, 0]):
        lengths = jnp.asarray(lengths, jnp.int32)
        out = step(q, k, v, lengths, parents)
        ref = tree_attention_reference(q, k, v, lengths, parents)
        assert max_abs_diff(out, ref) <= 1e-5
    assert len(traces) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33])
def test_ancestor_mask_matches_walk(n):
    parents = random_parents(np.random.default_rng(n), 4, n, "random")
    np.testing.assert_array_equal(np.asarray(jax.jit(ancestor_mask)(parents)),
                                  naive_ancestors(parents))


def test_resolve_attention_impl():
    assert resolve_attention_impl("reference") == "reference"
    assert resolve_attention_impl("pallas") == "pallas"
    expected = "reference" if jax.default_backend() == "cpu" else "pallas"
    assert resolve_attention_impl("auto") == expected
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        resolve_attention_impl("flash")


def test_block_k_must_divide_cache():
    args = make_inputs(np.random.default_rng(0), n=1, s=200, g=1, dh=64, kind="chain",
                       dtype=jnp.float32, hkv=1, lengths=[3])
    with pytest.raises(ValueError, match="block_k=128 must divide"):
        tree_attention(*args, impl="pallas", block_k=128)


def _abstract_args(dtype, dh=128):
    shapes = [(2, 8, 16, dh), (2, 2, 1024, dh), (2, 2, 1024, dh)]
    return ([jax.ShapeDtypeStruct(s, dtype) for s in shapes]
            + [jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 16), jnp.int32)])


@pytest.mark.parametrize("dh", [128, 48])
def test_triton_variant_lowers_for_cuda(dh):
    """Pallas -> Triton IR lowering (PTX compilation needs a GPU and is not checked); a head size
    that is not a power of two (Qwen3-style 48) lowers through its zero-padded lanes."""
    fn = jax.jit(functools.partial(tree_attention_pallas, variant="triton", interpret=False))
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=[check])(*_abstract_args(jnp.bfloat16, dh))
    assert exp.out_avals[0].shape == (2, 8, 16, dh)


def test_tpu_variant_lowers_to_mosaic(monkeypatch):
    """Pallas -> Mosaic lowering with a pretend TPU v5e (Mosaic's own passes need libtpu)."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    fn = jax.jit(functools.partial(tree_attention_pallas, variant="tpu", interpret=False))
    check = jax.export.DisabledSafetyCheck.custom_call("tpu_custom_call")
    jax.export.export(fn, platforms=["tpu"], disabled_checks=[check])(*_abstract_args(jnp.bfloat16))
