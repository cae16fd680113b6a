"""`generate` with and without the CPU kernels (hsd_jax.cpu_kernels), side by side in one process:
methods x {off, on} interleaved per prompt, tokens/s and ms a round over all prompts, compile
times, and whether every output equals ar without the kernels.

`--scope all` switches every kernel (`HSD_CPU_KERNELS`); `--scope drafter` keeps the target on its
kernels and switches only the feature drafters' (their packed layer and draft head,
`api.serving_drafter_params`), with ar as the noise control.

    python benchmarks/cpu_kernel.py --suite mt_bench --num-prompts 8 --max-new-tokens 96 --json OUT
    python benchmarks/cpu_kernel.py --scope drafter --tree 3/2/2 --reuse refresh --json OUT
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from unittest import mock

from hsd_jax import api, generate, load_drafter, load_target
from hsd_jax.prompts import load_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-cache-len", type=int, default=2048)
    ap.add_argument("--scope", choices=("all", "drafter"), default="all")
    ap.add_argument("--tree", default="3/3/1", help="nodes/depth/top-k of the small trees")
    ap.add_argument("--reuse", default=None, help="hsd reuse policy (default: SpecConfig's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target = load_target("smollm2-135m", max_cache_len=args.max_cache_len)
    prompts = [target.encode(p, chat=True) for p in load_suite(args.suite, args.num_prompts)]
    n, d, k = (int(x) for x in args.tree.split("/"))
    hsd = dict(method="hsd", drafter=load_drafter("hsd", target=target), tree_nodes=n, tree_depth=d, tree_top_k=k,
               **({"reuse": args.reuse} if args.reuse else {}))
    eagle = dict(method="eagle", drafter=load_drafter("eagle", target=target), tree_nodes=n, tree_depth=d, tree_top_k=k)
    methods = {"ar": {}, f"hsd {args.tree}": hsd, f"hsd {args.tree}+lookup4": dict(hsd, lookup_slots=4),
               f"eagle {args.tree}": eagle}
    if args.scope == "all":
        methods = {"ar": {}, "lookup": dict(method="lookup", drafter=load_drafter("lookup", target=target), gamma=6),
                   **{k: v for k, v in methods.items() if k != "ar"},
                   "hsd 8/4/3": dict(hsd, tree_nodes=8, tree_depth=4, tree_top_k=3)}
    modes = ("off", "on")

    def switched(mode):
        """The kernels of the chosen scope off or on."""
        if args.scope == "all":
            os.environ["HSD_CPU_KERNELS"] = "1" if mode == "on" else "0"
            return contextlib.nullcontext()
        if mode == "on":
            return contextlib.nullcontext()
        return mock.patch.object(api, "serving_drafter_params", lambda drafter, target: drafter.params)

    res = {}
    for mode in modes:
        for name, kw in methods.items():
            with switched(mode):
                r = generate(target, prompts[:1], max_new_tokens=8, **kw)[0]
            res[(mode, name)] = {"compile_seconds": r.stats["compile_seconds"], "seconds": 0.0, "tokens": 0,
                                 "rounds": 0, "ids": []}
    for p in prompts:
        for mode in modes:
            for name, kw in methods.items():
                with switched(mode):
                    r = generate(target, [p], max_new_tokens=args.max_new_tokens, **kw)[0]
                rec = res[(mode, name)]
                rec["seconds"] += r.stats["seconds"]
                rec["tokens"] += r.stats["new_tokens"]
                rec["rounds"] += r.stats["rounds"]
                rec["ids"].append(r.token_ids)
    ref = res[("off", "ar")]["ids"]
    ar = {m: res[(m, "ar")]["tokens"] / res[(m, "ar")]["seconds"] for m in modes}
    table = {}
    for (mode, name), rec in res.items():
        tps = rec["tokens"] / rec["seconds"]
        ms = 1e3 * rec["seconds"] / max(rec["rounds"], 1)   # ar: a round is a token
        table.setdefault(name, {})[mode] = {
            "tokens_per_s": round(tps, 2), "speedup_vs_ar": round(tps / ar[mode], 3), "ms_per_round": round(ms, 2),
            "compile_seconds": round(rec["compile_seconds"], 2), "identical_to_ar_off": rec["ids"] == ref}
        print(f"{name:22s} {args.scope} kernels {mode:3s}: {tps:6.2f} tok/s, {tps / ar[mode]:.2f}x ar ({mode}), "
              f"{ms:5.1f} ms/round, compile {rec['compile_seconds']:.1f} s, identical to ar (off): {rec['ids'] == ref}")
    for name, row in table.items():
        print(f"{name:22s} on/off: {row['on']['tokens_per_s'] / row['off']['tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                       "scope": args.scope, "tree": args.tree, "reuse": args.reuse, "methods": table}, f, indent=1)


if __name__ == "__main__":
    main()
