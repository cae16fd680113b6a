"""Tree attention by new rows and cache capacity, 30 SmolLM2-shaped layers over a stacked cache as
the model holds it ([L, B, Hkv, S, Dh], 64 slots free): the XLA reference (on the layer's slice of
the stack, as the model runs it), a multiply-and-reduce form of its score product (the trick that
streams the LM head), and `hsd_jax.cpu_kernels.tree_attention` (reads the stack in place, only
the visible slots) where it builds.

    python benchmarks/attention_rows.py [--capacities 640,1664] [--rows 1,4,8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax import cpu_kernels
from pallas_kernels.tree_attention import (
    MASK_VALUE,
    _default_scale,
    _visible_mask,
    ancestor_mask,
    tree_attention_reference,
)

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def multiply_reduce(q, k_cache, v_cache, lengths, parents, sm_scale=None):
    """The reference's semantics with scores as sum(q * k, -1): one fused loop over the cache."""
    b, hq, n, dh = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, hkv, hq // hkv * n, dh)
    logits = jnp.sum(qg[:, :, :, None, :] * k_cache[:, :, None], -1) * _default_scale(sm_scale, dh)
    visible = _visible_mask(lengths, parents, s)[:, None, None]
    probs = jax.nn.softmax(jnp.where(visible, logits.reshape(b, hkv, hq // hkv, n, s), MASK_VALUE), axis=-1)
    out = jnp.einsum("bhrs,bhsd->bhrd", probs.reshape(b, hkv, -1, s), v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, n, dh).astype(q.dtype)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacities", default="640,1664")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    for s in (int(x) for x in a.capacities.split(",")):
        for n in (int(x) for x in a.rows.split(",")):
            q = jnp.asarray(rng.normal(size=(LAYERS, 1, HEADS, n, HEAD_DIM)), jnp.float32)
            k, v = (jnp.asarray(rng.normal(size=(LAYERS, 1, KV_HEADS, s, HEAD_DIM)), jnp.float32) for _ in range(2))
            lengths = jnp.asarray([s - 64], jnp.int32)
            parents = jnp.asarray([np.arange(-1, n - 1)], jnp.int32)
            forms = {"reference": lambda q, k, v, l: tree_attention_reference(q, k[l], v[l], lengths, parents),
                     "multiply_reduce": lambda q, k, v, l: multiply_reduce(q, k[l], v[l], lengths, parents)}
            if cpu_kernels.enabled():
                anc = ancestor_mask(parents)
                forms["cpu_kernel"] = lambda q, k, v, l: cpu_kernels.tree_attention(q, k, v, l, lengths, anc, HEAD_DIM ** -0.5)
            row = {}
            for name, fn in forms.items():
                run = jax.jit(lambda q, k, v, fn=fn: jax.lax.map(lambda x: fn(x[0], k, v, x[1]),
                                                                 (q, jnp.arange(LAYERS, dtype=jnp.int32))))
                out = run(q, k, v).block_until_ready()
                times = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    run(q, k, v).block_until_ready()
                    times.append(time.perf_counter() - t0)
                row[name] = (round(statistics.median(times) * 1e3, 2), out)
            print(f"capacity {s}, {n} rows ({LAYERS} layers): " + ", ".join(
                f"{name} {ms} ms (max |diff| {float(jnp.max(jnp.abs(out - row['reference'][1]))):.1e})"
                for name, (ms, out) in row.items()), flush=True)


if __name__ == "__main__":
    main()
