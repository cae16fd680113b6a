"""`generate` with and without the CPU layer kernel (hsd_jax.cpu_kernels), side by side in one
process: methods x {off, on} interleaved per prompt, tokens/s over all prompts, compile times,
and whether every output equals ar without the kernel.

    python benchmarks/cpu_kernel.py --suite mt_bench --num-prompts 8 --max-new-tokens 96 --json OUT
"""
from __future__ import annotations

import argparse
import json
import os

from hsd_jax import generate, load_drafter, load_target
from hsd_jax.prompts import load_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-cache-len", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target = load_target("smollm2-135m", max_cache_len=args.max_cache_len)
    prompts = [target.encode(p, chat=True) for p in load_suite(args.suite, args.num_prompts)]
    hsd = load_drafter("hsd", target=target)
    chain = dict(method="hsd", drafter=hsd, tree_nodes=3, tree_depth=3, tree_top_k=1)
    methods = {"ar": {}, "lookup": dict(method="lookup", drafter=load_drafter("lookup", target=target), gamma=6),
               "hsd 3/3/1": chain, "hsd 3/3/1+lookup4": dict(chain, lookup_slots=4),
               "hsd 8/4/3": dict(method="hsd", drafter=hsd, tree_nodes=8, tree_depth=4, tree_top_k=3),
               "eagle 3/3/1": dict(chain, method="eagle", drafter=load_drafter("eagle", target=target))}
    modes = ("off", "on")
    res = {}
    for mode in modes:
        os.environ["HSD_CPU_KERNELS"] = "1" if mode == "on" else "0"
        for name, kw in methods.items():
            r = generate(target, prompts[:1], max_new_tokens=8, **kw)[0]
            res[(mode, name)] = {"compile_seconds": r.stats["compile_seconds"], "seconds": 0.0, "tokens": 0, "ids": []}
    for p in prompts:
        for mode in modes:
            os.environ["HSD_CPU_KERNELS"] = "1" if mode == "on" else "0"
            for name, kw in methods.items():
                r = generate(target, [p], max_new_tokens=args.max_new_tokens, **kw)[0]
                rec = res[(mode, name)]
                rec["seconds"] += r.stats["seconds"]
                rec["tokens"] += r.stats["new_tokens"]
                rec["ids"].append(r.token_ids)
    ref = res[("off", "ar")]["ids"]
    ar = {m: res[(m, "ar")]["tokens"] / res[(m, "ar")]["seconds"] for m in modes}
    table = {}
    for (mode, name), rec in res.items():
        tps = rec["tokens"] / rec["seconds"]
        table.setdefault(name, {})[mode] = {"tokens_per_s": round(tps, 2), "speedup_vs_ar": round(tps / ar[mode], 3),
                                            "compile_seconds": round(rec["compile_seconds"], 2),
                                            "identical_to_ar_off": rec["ids"] == ref}
        print(f"{name:18s} kernel {mode:3s}: {tps:6.2f} tok/s, {tps / ar[mode]:.2f}x ar ({mode}), "
              f"compile {rec['compile_seconds']:.1f} s, identical to ar (off): {rec['ids'] == ref}")
    for name, row in table.items():
        print(f"{name:18s} on/off: {row['on']['tokens_per_s'] / row['off']['tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                       "methods": table}, f, indent=1)


if __name__ == "__main__":
    main()
