"""A bf16 target against the f32 one on the CPU, in one process, methods interleaved per prompt
(`bench.run_bench`): tokens/s of bf16 `ar` over f32 `ar`, and whether every method on the bf16
target gives bf16 `ar`'s tokens (they are the bf16 model's outputs, not the f32 model's).

    python benchmarks/bf16_cpu.py --suite mt_bench --num-prompts 6 --max-new-tokens 64 --json OUT
"""
from __future__ import annotations

import argparse
import json
import statistics

from hsd_jax import cpu_kernels, generate, load_drafter, load_target
from hsd_jax.bench import run_bench
from hsd_jax.prompts import load_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default="3/2/2", help="nodes/depth/top-k of the speculative methods")
    ap.add_argument("--methods", default="lookup,ngram,hsd,hsd+lookup4", help="on the bf16 target, beside ar")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each method per prompt (the fastest counts)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    targets = {dt: load_target("smollm2-135m", dtype=dt) for dt in ("bfloat16", "float32")}
    prompts = [targets["float32"].encode(p, chat=True) for p in load_suite(args.suite, args.num_prompts)]
    n, d, k = (int(x) for x in args.tree.split("/"))
    tree = dict(tree_nodes=n, tree_depth=d, tree_top_k=k)
    bf16 = targets["bfloat16"]
    kinds = {"lookup": lambda: dict(method="lookup", drafter=load_drafter("lookup", target=bf16), gamma=6),
             "ngram": lambda: dict(method="ngram", drafter=load_drafter("ngram", target=bf16), **tree),
             "hsd": lambda: dict(method="hsd", drafter=load_drafter("hsd", target=bf16), **tree),
             "hsd+lookup4": lambda: dict(method="hsd", drafter=load_drafter("hsd", target=bf16), lookup_slots=4, **tree)}
    methods = {"ar": (bf16, {}), "ar f32": (targets["float32"], {})}
    methods.update({f"{m} bf16": (bf16, kinds[m]()) for m in args.methods.split(",") if m})

    decode = {}   # (method, prompt) -> fastest (decode seconds, new tokens): tokens/s without the prefill

    def runner(name, target, kw):
        def run(batch):
            res = generate(target, batch, max_new_tokens=args.max_new_tokens, **kw)
            key, now = (name, tuple(batch[0])), (res[0].stats["decode_seconds"], res[0].stats["new_tokens"])
            decode[key] = min(decode.get(key, now), now)
            return res
        return run

    res = run_bench({name: runner(name, t, kw) for name, (t, kw) in methods.items()}, prompts, progress=True,
                    repeats=args.repeats)
    ar = res["ar"]["tokens_per_s"]
    for name, r in res.items():
        print(f"{name:18s} {r['tokens_per_s']:7.2f} tok/s  {r['speedup_vs_ar']:.3f}x bf16 ar  tau {r['tau']:.2f}  "
              f"identical to bf16 ar: {r['identical_to_ar']}  compile {r['compile_seconds']:.1f} s")
    print(f"bf16 ar / f32 ar: {1 / res['ar f32']['speedup_vs_ar']:.3f}x (medians per prompt; tok/s {ar:.1f} vs "
          f"{res['ar f32']['tokens_per_s']:.1f})")
    per_prompt = {name: [decode[(name, tuple(p))] for p in prompts] for name in methods}
    decode_ratio = statistics.median((f[0] / f[1]) / (b[0] / b[1]) for f, b in zip(per_prompt["ar f32"], per_prompt["ar"]))
    print(f"decode only (prefill left out), bf16 ar / f32 ar: {decode_ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                       "tree": args.tree, "cpu_kernel": cpu_kernels.enabled(), "methods": res,
                       "decode_only_bf16_over_f32_ar": round(decode_ratio, 3)}, f, indent=1)


if __name__ == "__main__":
    main()
