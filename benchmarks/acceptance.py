"""Acceptance (tau) of the shipped drafters with the engine on a real suite, batched for speed.

tau does not depend on batching, so all prompts run as one batch per method; wall time is not
the point here (use `hsd bench` for speed). At T=0 every method's output is checked against ar's;
at T>0 outputs are samples (lossless, not identical), so only tau is reported.

    python benchmarks/acceptance.py --suite mt_bench --num-prompts 80 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="hsd-noreuse,hsd-refresh,hsd-chain,eagle,sd,ngram")
    ap.add_argument("--tree-nodes", type=int, default=None, help="default: SpecConfig's (8)")
    ap.add_argument("--tree-depth", type=int, default=None, help="default: SpecConfig's (4)")
    ap.add_argument("--top-k", type=int, default=None, help="default: SpecConfig's (3)")
    ap.add_argument("--drafter", action="append", default=[], metavar="KIND=DIR",
                    help="use this drafter directory for a kind (e.g. hsd=runs/smollm2_hsd_v2/drafter); default: shipped")
    ap.add_argument("--prompt-bucket", type=int, default=None,
                    help="pad every prompt to one length (e.g. 512 for MT-bench): one compile per method at batch 1")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from hsd_jax import generate, load_drafter, load_target
    from hsd_jax.bench import drafter_paths, method_spec
    from hsd_jax.engine import SpecConfig
    from hsd_jax.prompts import load_suite

    paths = drafter_paths(args.drafter)
    target = load_target()
    ids = [target.encode(p, chat=True) for p in load_suite(args.suite, args.num_prompts)]
    batches = [ids[i: i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    sampling = dict(temperature=args.temperature, seed=args.seed)
    if args.prompt_bucket:
        sampling["prompt_bucket"] = args.prompt_bucket
    ar = None
    if args.temperature == 0:
        ar = [r.token_ids for b in batches for r in generate(target, b, max_new_tokens=args.max_new_tokens, **sampling)]
    spec = SpecConfig(tree_nodes=args.tree_nodes or SpecConfig.tree_nodes, tree_depth=args.tree_depth or SpecConfig.tree_depth,
                      tree_top_k=args.top_k or SpecConfig.tree_top_k)
    tree = dict(tree_nodes=spec.tree_nodes, tree_depth=spec.tree_depth, tree_top_k=spec.tree_top_k)
    out = {"suite": args.suite, "prompts": len(ids), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
           **sampling, "tree": tree,
           "drafters": paths, "methods": {}}
    for name in args.methods.split(","):
        kind, opts = method_spec(name)
        drafter = load_drafter(kind, paths.get(kind), target=target)
        res = [r for b in batches for r in generate(target, b, max_new_tokens=args.max_new_tokens, method=kind,
                                                    drafter=drafter, **sampling, **opts,
                                                    **({} if kind == "sd" else tree))]
        rounds = sum(r.stats["rounds"] for r in res)
        new = sum(r.stats["new_tokens"] for r in res)
        hist = [sum(r.stats["accepted_hist"][i] for r in res) for i in range(len(res[0].stats["accepted_hist"]))]
        out["methods"][name] = {"tau": round((new - len(res)) / rounds, 3), "rounds": rounds, "new_tokens": new,
                                "drafter_forwards_per_token": round(sum(r.stats["drafter_forwards"] for r in res) / new, 3),
                                "accepted_hist": hist, "identical_to_ar": None if ar is None else [r.token_ids for r in res] == ar}
        print(name, out["methods"][name], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
