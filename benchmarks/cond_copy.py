"""Why a `lax.cond` around the verify forward is dear on the CPU: XLA copies a buffer into a
conditional's branch when the branch runs a loop that updates it in place (the layer scan over
the KV cache), and copies the result out again; the same update unrolled, or without the
conditional, runs in place. Prints ms per iteration and the whole-buffer copies in the compiled
program for each form.

    python benchmarks/cond_copy.py --layers 30 --slots 1024
"""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    n_layers, iters = args.layers, args.iters
    cache = jnp.zeros((n_layers, 1, 3, args.slots, 64), jnp.float32)

    def write(c, layer, i, rows):   # one layer's new K for `rows` tokens at slot i
        return jax.lax.dynamic_update_slice(c, jnp.full((1, 1, 3, rows, 64), i, jnp.float32), (layer, 0, 0, i, 0))

    def looped(c, i, rows):
        return jax.lax.fori_loop(0, n_layers, lambda layer, c: write(c, layer, i, rows), c)

    def unrolled(c, i, rows):
        for layer in range(n_layers):
            c = write(c, layer, i, rows)
        return c

    forms = {
        "loop, no cond": lambda i, c: looped(c, i, 8),
        "loop in a cond": lambda i, c: jax.lax.cond(i % 2 == 0, lambda: looped(c, i, 4), lambda: looped(c, i, 8)),
        "unrolled in a cond": lambda i, c: jax.lax.cond(i % 2 == 0, lambda: unrolled(c, i, 4),
                                                        lambda: unrolled(c, i, 8)),
    }
    shape = re.escape(f"f32[{n_layers},1,3,{args.slots},64]")
    print(f"buffer {cache.nbytes / 2**20:.1f} MiB, {iters} iterations")
    for name, body in forms.items():
        fn = jax.jit(lambda c, body=body: jax.lax.fori_loop(0, iters, body, c))
        jax.block_until_ready(fn(cache))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(cache))
        ms = (time.perf_counter() - t0) / iters * 1e3
        copies = len(re.findall(shape + r"\{[^}]*\} copy\(", fn.lower(cache).compile().as_text()))
        print(f"{name:20s} {ms:7.3f} ms/iteration, {copies} whole-buffer copies in the program")


if __name__ == "__main__":
    main()
