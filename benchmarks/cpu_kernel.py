"""`generate` with and without the CPU kernels (hsd_jax.cpu_kernels), side by side in one process:
methods x {off, on} interleaved per prompt, tokens/s and ms a round over all prompts, compile
times, and whether every output equals ar without the kernels.

`--scope all` switches every kernel (`HSD_CPU_KERNELS`); `--scope drafter` keeps the target on its
kernels and switches only the feature drafters' (their packed layer and draft head,
`api.serving_drafter_params`: off, f32, bf16 weights), with ar as the noise control and ngram at the
same tree (+4 lookup nodes) as the drafter-free round: hsd's round minus ngram's is the drafter's share. `--scope bf16`: a bf16 target against
the f32 one, both on the kernels (`bf16_vs_f32`).

    python benchmarks/cpu_kernel.py --suite mt_bench --num-prompts 8 --max-new-tokens 96 --json OUT
    python benchmarks/cpu_kernel.py --scope drafter --tree 3/2/2 --reuse refresh --json OUT
    python benchmarks/cpu_kernel.py --scope bf16 --num-prompts 4 --max-new-tokens 64 --methods "" --repeats 3
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
    ap.add_argument("--scope", choices=("all", "drafter", "bf16"), default="all")
    ap.add_argument("--tree", default="3/3/1", help="nodes/depth/top-k of the small trees")
    ap.add_argument("--reuse", default=None, help="hsd reuse policy (default: SpecConfig's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--methods", default="lookup,ngram,hsd,hsd+lookup4", help="bf16: on the bf16 target, beside ar")
    ap.add_argument("--repeats", type=int, default=1, help="bf16: runs of each method per prompt (the fastest counts)")
    args = ap.parse_args()
    if args.scope == "bf16":
        return bf16_vs_f32(args)
    target = load_target("smollm2-135m", max_cache_len=args.max_cache_len)
    prompts = [target.encode(p, chat=True) for p in load_suite(args.suite, args.num_prompts)]
    n, d, k = (int(x) for x in args.tree.split("/"))
    hsd = dict(method="hsd", drafter=load_drafter("hsd", target=target), tree_nodes=n, tree_depth=d, tree_top_k=k,
               **({"reuse": args.reuse} if args.reuse else {}))
    eagle = dict(method="eagle", drafter=load_drafter("eagle", target=target), tree_nodes=n, tree_depth=d, tree_top_k=k)
    ngram = dict(method="ngram", drafter=load_drafter("ngram", target=target), tree_nodes=n, tree_depth=d,
                 tree_top_k=k, lookup_slots=4)
    methods = {"ar": {}, f"hsd {args.tree}": hsd, f"hsd {args.tree}+lookup4": dict(hsd, lookup_slots=4),
               f"eagle {args.tree}": eagle, f"ngram {args.tree}+lookup4": ngram}
    if args.scope == "all":
        methods = {"ar": {}, "lookup": dict(method="lookup", drafter=load_drafter("lookup", target=target), gamma=6),
                   **{k: v for k, v in methods.items() if k != "ar"},
                   "hsd 8/4/3": dict(hsd, tree_nodes=8, tree_depth=4, tree_top_k=3)}
    modes = ("off", "on") if args.scope == "all" else ("off", "f32", "bf16")

    def switched(mode):
        """The kernels of the chosen scope off or on (drafter: on with f32 or bf16 weights)."""
        if args.scope == "all":
            os.environ["HSD_CPU_KERNELS"] = "1" if mode == "on" else "0"
            return contextlib.nullcontext()
        if mode == "off":
            return mock.patch.object(api, "serving_drafter_params", lambda drafter, target: drafter.params)
        return mock.patch.object(api, "DRAFTER_KERNEL_DTYPE", "float32" if mode == "f32" else "bfloat16")

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
            "tau": round(rec["tokens"] / max(rec["rounds"], 1), 3),
            "compile_seconds": round(rec["compile_seconds"], 2), "identical_to_ar_off": rec["ids"] == ref}
        print(f"{name:22s} {args.scope} kernels {mode:3s}: {tps:6.2f} tok/s, {tps / ar[mode]:.2f}x ar ({mode}), "
              f"{ms:5.1f} ms/round, compile {rec['compile_seconds']:.1f} s, identical to ar (off): {rec['ids'] == ref}")
    for name, row in table.items():
        print(f"{name:22s} {modes[-1]}/off: {row[modes[-1]]['tokens_per_s'] / row['off']['tokens_per_s']:.2f}x")
    if args.scope == "drafter":   # the drafter's share of an hsd round: what it costs beyond ngram's at the same tree
        hsd_row, ngram_row = table[f"hsd {args.tree}+lookup4"], table[f"ngram {args.tree}+lookup4"]
        for mode in modes:
            h, g = hsd_row[mode]["ms_per_round"], ngram_row[mode]["ms_per_round"]
            hsd_row[mode]["drafter_ms_per_round"] = round(h - g, 2)
            hsd_row[mode]["drafter_share_of_round"] = round((h - g) / h, 3)
            print(f"drafter ({mode}): {h - g:.1f} ms of a {h:.1f} ms hsd+lookup4 round ({(h - g) / h:.0%}; "
                  f"ngram's round {g:.1f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                       "scope": args.scope, "tree": args.tree, "reuse": args.reuse, "methods": table}, f, indent=1)


def bf16_vs_f32(args) -> None:
    """A bf16 target against the f32 one, in one process, methods interleaved per prompt
    (`bench.run_bench`): tokens/s of bf16 `ar` over f32 `ar` (and without the prefill), and whether
    every method on the bf16 target gives bf16 `ar`'s tokens (the bf16 model's outputs, not the f32
    model's)."""
    import statistics

    from hsd_jax import cpu_kernels
    from hsd_jax.bench import run_bench

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
