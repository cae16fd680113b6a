"""The LM head alone (SmolLM2's tied 49152 x 576 matrix) by rows N, in several forms, interleaved
rounds, medians: where the verify forward's multi-row penalty comes from (BENCHMARKS.md, issue 19).

    python benchmarks/lm_head_cost.py --json benchmarks/results/cpu-2cores/lm_head_cost.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from hsd_jax.bench import machine_info

    v, d, sizes = 49152, 576, (1, 2, 4, 8, 16)
    e = jnp.asarray(np.random.default_rng(0).standard_normal((v, d)).astype(np.float32))
    forms = {
        "f32 x.E^T (as the engine)": (jax.jit(lambda x, w: jnp.einsum("nd,vd->nv", x, w)), e),
        "f32 x @ [d, V] copy": (jax.jit(lambda x, w: x @ w), jnp.asarray(np.asarray(e).T.copy())),
        "f32 one GEMV per row": (jax.jit(lambda x, w: jnp.stack([w @ x[i] for i in range(x.shape[0])])), e),
        "bf16 weights, f32 accumulate": (jax.jit(lambda x, w: jnp.einsum(
            "nd,vd->nv", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)), e.astype(jnp.bfloat16)),
    }
    times = {k: {n: [] for n in sizes} for k in forms}
    xs = {n: jnp.ones((n, d), jnp.float32) for n in sizes}
    for f, w in forms.values():
        for n in sizes:
            f(xs[n], w).block_until_ready()
    for _ in range(args.rounds):
        for n in sizes:
            for k, (f, w) in forms.items():
                t0 = time.perf_counter()
                f(xs[n], w).block_until_ready()
                times[k][n].append(time.perf_counter() - t0)
    out = {"n": list(sizes), "machine": machine_info(), "rounds": args.rounds,
           "ms": {k: [round(1e3 * statistics.median(times[k][n]), 2) for n in sizes] for k in forms}}
    for k, ms in out["ms"].items():
        print(f"{k:30s} " + "  ".join(f"{n}:{m:.1f}" for n, m in zip(sizes, ms)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
