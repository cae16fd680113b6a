"""Time the Pallas tree-attention kernel against the jnp reference on verify shapes.

Prints (and optionally writes) a markdown table: shape, kernel ms, reference ms,
reference/kernel ratio, achieved GB/s (K+V bytes up to lengths + N over kernel
time) and the max |kernel - reference| as a correctness check. Failures of one
shape are reported in its row and do not stop the run.

    python benchmarks/tree_attention.py                 # accelerator shapes
    python benchmarks/tree_attention.py --small         # CPU (interpret mode)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.tree_attention import tree_attention_pallas, tree_attention_reference  # noqa: E402

FULL = dict(batch=(1, 4, 8), n=(1, 16, 64), seq=(1024, 4096), hq=32, hkv=8, dh=128)
SMALL = dict(batch=(1, 2), n=(1, 4), seq=(256,), hq=4, hkv=2, dh=64)


def make_case(batch, n, seq, hq, hkv, dh, dtype, seed=0):
    """Random q/cache, lengths in [S/2, S - N], random tree parents."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, hq, n, dh)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, hkv, seq, dh)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, hkv, seq, dh)), dtype)
    lengths = rng.integers(seq // 2, seq - n + 1, size=batch).astype(np.int32)
    parents = np.array([[rng.integers(-1, i) if i else -1 for i in range(n)]
                        for _ in range(batch)], np.int32)
    return q, k, v, jnp.asarray(lengths), jnp.asarray(parents)


def time_ms(fn, args, repeats):
    """Median wall time in ms after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kv_bytes(lengths, n, hkv, dh, dtype):
    """Bytes of K and V actually needed: slots below lengths + N."""
    return int(np.sum(np.asarray(lengths) + n)) * hkv * dh * 2 * jnp.dtype(dtype).itemsize


def bench_row(batch, n, seq, cfg, dtype, repeats, kernel, reference):
    args = make_case(batch, n, seq, cfg["hq"], cfg["hkv"], cfg["dh"], dtype)
    shape = f"B={batch} N={n} S={seq} Hq/Hkv={cfg['hq']}/{cfg['hkv']} Dh={cfg['dh']}"
    ref_ms = time_ms(reference, args, repeats)
    try:
        ker_ms = time_ms(kernel, args, repeats)
        diff = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32)
                                     - reference(*args).astype(jnp.float32))))
    except Exception as err:  # report and keep going: one bad shape should not hide the rest
        return f"| {shape} | error: {type(err).__name__}: {str(err)[:120]} | {ref_ms:.3f} | | | |"
    gbs = kv_bytes(args[3], n, cfg["hkv"], cfg["dh"], dtype) / (ker_ms * 1e-3) / 1e9
    return f"| {shape} | {ker_ms:.3f} | {ref_ms:.3f} | {ref_ms / ker_ms:.2f} | {gbs:.1f} | {diff:.2e} |"


def emit(lines, new, out):
    """Print new rows and rewrite the whole table to ``out`` (partial results survive a timeout)."""
    print("\n".join(new or lines), flush=True)
    lines.extend(new)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpret mode)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per shape")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: float32 on cpu, bfloat16 elsewhere")
    parser.add_argument("--variant", choices=("tpu", "triton"), default=None,
                        help="kernel variant; default by backend")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    cfg = SMALL if args.small else FULL
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    repeats = args.repeats or (3 if backend == "cpu" else 20)
    kernel = jax.jit(lambda *a: tree_attention_pallas(*a, variant=args.variant))
    reference = jax.jit(tree_attention_reference)

    lines = [f"# Tree attention: Pallas kernel vs jnp reference ({backend}, "
             f"{jax.devices()[0].device_kind}, {dtype.name}, jax {jax.__version__})", ""]
    if backend == "cpu":
        lines += ["Note: on CPU the kernel runs in Pallas interpret mode, which is slow "
                  "and says nothing about accelerator performance.", ""]
    lines += ["| shape | kernel ms | reference ms | ref/kernel | kernel GB/s | max abs diff |",
              "|---|---|---|---|---|---|"]
    emit(lines, [], args.out)
    for seq, batch, n in itertools.product(cfg["seq"], cfg["batch"], cfg["n"]):
        row = bench_row(batch, n, seq, cfg, dtype, repeats, kernel, reference)
        emit(lines, [row], args.out)


if __name__ == "__main__":
    main()
