"""The CPU tree-attention kernel of a git revision against the working tree's, in one process,
interleaved round by round: the kernel alone (SmolLM2's heads, its 30 layers a call, the cache in
memory) and inside the target's verify program (`tune.verify_program`, 1 new token = a decode step),
at each context and number of new tokens N. The revision's kernel is built from `git show REV:` with
this machine's flags and swapped in at trace time; outputs are checked bit for bit.

    python benchmarks/attention_ab.py --rev d7c520f --json benchmarks/results/cpu-2cores/zen4/attention_ab.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SOURCES = ("tree_attention.cc", "parallel.h")


def build_revision(rev: str, out_dir: str) -> str:
    """The tree-attention kernel as it was at `rev`, compiled as `kernel_build` compiles the library."""
    from hsd_jax import kernel_build

    for name in SOURCES:
        text = subprocess.run(["git", "show", f"{rev}:hsd_jax/cpu_kernels/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        Path(out_dir, name).write_text(text)
    lib = os.path.join(out_dir, "tree_attention_rev.so")
    subprocess.run([os.environ.get("CXX", "g++"), *kernel_build.FLAGS, *kernel_build.defines(),
                    f"-I{kernel_build.include_dir()}", "-shared", os.path.join(out_dir, SOURCES[0]), "-o", lib],
                   check=True, stderr=subprocess.DEVNULL)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the revision whose kernel is the baseline")
    ap.add_argument("--contexts", default="512,1536", help="tokens already in the cache")
    ap.add_argument("--sizes", default="1,4,8,16", help="new tokens N")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--parts", default="kernel,verify")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from hsd_jax import cpu_kernels, load_target
    from hsd_jax.api import serving_params
    from hsd_jax.bench import interleaved_ms, machine_info
    from hsd_jax.models import llama
    from hsd_jax.tune import in_place, verify_inputs, verify_program
    from pallas_kernels.tree_attention import ancestor_mask

    if not cpu_kernels.enabled():
        sys.exit("the CPU kernels are not enabled here (HSD_CPU_KERNELS=0, or their build failed)")
    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.cdll.LoadLibrary(build_revision(args.rev, tmp))
    jax.ffi.register_ffi_target("hsd_tree_attention_rev", jax.ffi.pycapsule(lib.TreeAttention), platform="cpu")

    def rev_attention(q, k_stack, v_stack, layer, lengths, ancestors, scale):
        return jax.ffi.ffi_call("hsd_tree_attention_rev", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q.astype(jnp.float32), k_stack, v_stack, jnp.asarray(layer, jnp.int32).reshape(1),
            lengths.astype(jnp.int32), ancestors.astype(jnp.int32), scale=np.float32(scale))

    kernels = {args.rev: rev_attention, "working tree": cpu_kernels.tree_attention}
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_target("smollm2-135m", tokenizer=False)
    cfg = target.config
    out = {"rev": args.rev, "rounds": args.rounds, "sizes": sizes, "machine": machine_info(), "kernel": {}, "verify": {}}
    rng = np.random.default_rng(0)
    layers, hq, hkv, dh = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def kernel_loop(fn):
        def run(q, k, v, lengths, anc):
            def body(layer, acc):
                return acc + fn(q, k, v, layer, lengths, anc, dh ** -0.5)
            return jax.lax.fori_loop(0, layers, body, jnp.zeros(q.shape, jnp.float32))
        return jax.jit(run)

    def with_kernel(program, fn):
        """`program` traced (on its first call at each shape) with `fn` as the kernel; both sides alike."""
        def call(*a):
            with mock.patch.object(cpu_kernels, "tree_attention", fn):
                return program(*a)
        return call

    for ctx in contexts:
        if "kernel" in args.parts:
            k = jnp.asarray(rng.standard_normal((layers, 1, hkv, ctx + max(sizes), dh)), jnp.float32)
            v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
            inputs = {}
            for n in sizes:
                parents = jnp.asarray([[-1] + [int(rng.integers(0, i)) for i in range(1, n)]], jnp.int32)
                q = jnp.asarray(rng.standard_normal((1, hq, n, dh)), jnp.float32)
                inputs[n] = [(q, k, v, jnp.asarray([ctx], jnp.int32), ancestor_mask(parents))]
            loops = {name: kernel_loop(fn) for name, fn in kernels.items()}
            same = all(np.array_equal(*(np.asarray(loop(*inputs[n][0])) for loop in loops.values())) for n in sizes)
            ms = interleaved_ms(loops, inputs, args.rounds)
            out["kernel"][ctx] = {"identical": same, **{name: [ms[name][n] for n in sizes] for name in loops}}
            print(f"kernel, {ctx} cached, {layers} layers, ms by N {sizes}: " + "; ".join(
                f"{name} {' '.join(f'{ms[name][n]:.2f}' for n in sizes)}" for name in loops) + f"; identical {same}")
        if "verify" in args.parts:
            params = serving_params(target, ready=True)
            inputs = {n: [(params, *verify_inputs(cfg, n, ctx, params), llama.head_screen(params, cfg, n))]
                      for n in sizes}
            programs = {name: in_place(with_kernel(verify_program(cfg), fn)) for name, fn in kernels.items()}
            ms = interleaved_ms(programs, inputs, args.rounds)
            out["verify"][ctx] = {name: {"ms": [ms[name][n] for n in sizes],
                                         "ratio_to_n1": [round(ms[name][n] / ms[name][sizes[0]], 3) for n in sizes]}
                                  for name in programs}
            for name in programs:
                r = out["verify"][ctx][name]
                print(f"verify, {ctx} cached, {name}: " + "  ".join(
                    f"{n}:{m:.1f}ms/{x:.2f}x" for n, m, x in zip(sizes, r["ms"], r["ratio_to_n1"])))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
