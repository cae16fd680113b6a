"""The feature drafters (hsd, eagle) with and without their own CPU kernels (packed layer weights
and draft-vocab head, `api.serving_drafter_params`), the target on its kernels in both, side by
side in one process: prompts x {off, on} interleaved, tokens/s, speedup vs ar, and whether every
output equals ar's.

    python benchmarks/drafter_kernels.py --suite mt_bench --num-prompts 8 --max-new-tokens 96 --json OUT
"""
from __future__ import annotations

import argparse
import json
from unittest import mock

from hsd_jax import api, generate, load_drafter, load_target
from hsd_jax.prompts import load_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tree", default="3/2/2", help="nodes/depth/top-k")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target = load_target("smollm2-135m", max_cache_len=2048)
    prompts = [target.encode(p, chat=True) for p in load_suite(args.suite, args.num_prompts)]
    n, d, k = (int(x) for x in args.tree.split("/"))
    tree = dict(tree_nodes=n, tree_depth=d, tree_top_k=k, reuse="refresh")
    hsd = dict(method="hsd", drafter=load_drafter("hsd", target=target), **tree)
    methods = {"ar": {}, f"hsd {args.tree}": hsd, f"hsd {args.tree}+lookup4": dict(hsd, lookup_slots=4),
               f"eagle {args.tree}": dict(tree, method="eagle", drafter=load_drafter("eagle", target=target))}
    modes = ("off", "on")
    unpacked = lambda drafter, target: drafter.params

    def run(mode, kw, p, tokens):
        if mode == "on":
            return generate(target, [p], max_new_tokens=tokens, **kw)[0]
        with mock.patch.object(api, "serving_drafter_params", unpacked):
            return generate(target, [p], max_new_tokens=tokens, **kw)[0]

    res = {}
    for mode in modes:
        for name, kw in methods.items():
            r = run(mode, kw, prompts[0], 8)
            res[(mode, name)] = {"compile_seconds": r.stats["compile_seconds"], "seconds": 0.0, "tokens": 0,
                                 "rounds": 0, "ids": []}
    for p in prompts:
        for mode in modes:
            for name, kw in methods.items():
                r = run(mode, kw, p, args.max_new_tokens)
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
        ms = 1e3 * rec["seconds"] / max(rec["rounds"], 1)
        table.setdefault(name, {})[mode] = {
            "tokens_per_s": round(tps, 2), "speedup_vs_ar": round(tps / ar[mode], 3), "ms_per_round": round(ms, 2),
            "compile_seconds": round(rec["compile_seconds"], 2), "identical_to_ar": rec["ids"] == ref}
        print(f"{name:22s} drafter kernels {mode:3s}: {tps:6.2f} tok/s, {tps / ar[mode]:.2f}x ar, "
              f"{ms:5.1f} ms/round, compile {rec['compile_seconds']:.1f} s, identical to ar: {rec['ids'] == ref}")
    for name, row in table.items():
        print(f"{name:22s} on/off: {row['on']['tokens_per_s'] / row['off']['tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                       "tree": args.tree, "results": table}, f, indent=1)


if __name__ == "__main__":
    main()
