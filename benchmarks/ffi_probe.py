"""The matmul kernel of `hsd_jax.cpu_kernels` against XLA's dots, outside the model: does reading
the stacked layer weights in place (`stacked_matmul.cc`, an XLA FFI handler) beat XLA's
copy-then-GEMM for a few rows? (The probe that led to adopting it, issue 19.)

Uses the package's kernel library (both layouts), then times SmolLM2-135M's 30 MLPs (d 576, f 1536) over N rows inside one
`lax.scan`, as the target's forward runs them: XLA's dots on the scan's weight slices against
the FFI handler on the whole stacks, as stored and pre-packed in 32-column tiles. Interleaved, medians; outputs compared.

    python benchmarks/ffi_probe.py --sizes 1,2,4,8,16
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax import cpu_kernels


def register_plain_layout() -> None:
    """The package's kernel library (built on first use) also holds the handler for the weights as
    stored ([L, d, f]), which the package never calls: register it for the comparison."""
    if not cpu_kernels.enabled():
        raise SystemExit("the CPU kernels could not be built here (see the warning above)")
    lib = ctypes.cdll.LoadLibrary(cpu_kernels._library_path())
    jax.ffi.register_ffi_target("hsd_stacked_matmul", jax.ffi.pycapsule(lib.StackedMatmul), platform="cpu")


def stacked_matmul(x, w, layer):
    """x [N, d] @ w[layer]: w [L, d, f] (plain) or [L, f / 32, d, 32] (packed: the package's call)."""
    if w.ndim == 4:
        return cpu_kernels.stacked_matmul(x, w, layer)
    return jax.ffi.ffi_call("hsd_stacked_matmul", jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), x.dtype))(
        x, w, jnp.asarray(layer, jnp.int32).reshape(1), jnp.ones((x.shape[0],), jnp.int32))


def mlps_xla(x, wg, wu, wd):
    def body(x, ws):
        g, u, d = ws
        return x + 0.01 * ((jax.nn.silu(x @ g) * (x @ u)) @ d), None
    return jax.lax.scan(body, x, (wg, wu, wd))[0]


def mlps_ffi(x, wg, wu, wd):
    def body(x, i):
        h = jax.nn.silu(stacked_matmul(x, wg, i)) * stacked_matmul(x, wu, i)
        return x + 0.01 * stacked_matmul(h, wd, i), None
    return jax.lax.scan(body, x, jnp.arange(wg.shape[0], dtype=jnp.int32))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    register_plain_layout()
    rng = np.random.default_rng(0)
    L, d, f = args.layers, args.hidden, args.inter
    wg, wu = (jnp.asarray(rng.normal(0, 0.04, (L, d, f)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(0, 0.03, (L, f, d)), jnp.float32)
    plain, packed = (wg, wu, wd), tuple(jnp.asarray(cpu_kernels.pack(w)) for w in (wg, wu, wd))
    runs = {}
    for n in map(int, args.sizes.split(",")):
        x = jnp.asarray(rng.normal(0, 1, (n, d)), jnp.float32)
        for name, fn, ws in (("xla", mlps_xla, plain), ("ffi", mlps_ffi, plain), ("ffi-packed", mlps_ffi, packed)):
            runs[(name, n)] = (jax.jit(fn).lower(x, *ws).compile(), x, ws, [])
        ref = np.asarray(runs[("xla", n)][0](x, *plain))
        for k in ("ffi", "ffi-packed"):
            print(f"N={n}: max |xla - {k}| = {np.abs(ref - np.asarray(runs[(k, n)][0](x, *runs[(k, n)][2]))).max():.2e}")
    for _ in range(args.rounds):
        for exe, x, ws, ts in runs.values():
            t0 = time.perf_counter()
            jax.block_until_ready(exe(x, *ws))
            ts.append(time.perf_counter() - t0)
    one = statistics.median(runs[("xla", 1)][3])
    for (name, n), (_, _, _, ts) in runs.items():
        ms = statistics.median(ts)
        print(f"{name} N={n:2d}: {ms * 1e3:6.2f} ms  ({ms / one:.2f}x XLA at N=1)")


if __name__ == "__main__":
    main()
