"""The target's verify forward by number of new tokens N: what a draft tree of N slots costs
against one decode step (batch 1, a filled KV cache), all N interleaved round by round so a
machine's drift hits every N alike; medians.

Three programs per N, jitted as the engine runs them: `forward` (the layers, tree attention,
the cache write), `verify` (forward plus the LM head on every slot, as `engine.verify_tree`) and
`verify_dot_head` (the same with the head as one dot, the form before `llama.streams_head_rows`).

    python benchmarks/verify_cost.py --json benchmarks/results/cpu-2cores/verify_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax

    from hsd_jax import load_target
    from hsd_jax.bench import machine_info
    from hsd_jax.models import llama
    from hsd_jax.tune import verify_inputs, verify_program

    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_target(args.model, tokenizer=False)
    cfg = target.config

    def forward(params, toks, pos, cache, parents):
        return llama.forward(params, cfg, toks, pos, cache, parents).features

    def verify_dot_head(params, toks, pos, cache, parents):
        return llama.logits_from_features(params, cfg, llama.forward(params, cfg, toks, pos, cache, parents).features)

    programs = {"forward": jax.jit(forward), "verify": verify_program(cfg),
                "verify_dot_head": jax.jit(verify_dot_head)}
    inputs = {n: verify_inputs(cfg, n, args.context) for n in sizes}
    for n in sizes:
        for fn in programs.values():
            jax.block_until_ready(fn(target.params, *inputs[n]))     # compile and warm up
    times = {name: {n: [] for n in sizes} for name in programs}
    for _ in range(args.rounds):
        for n in sizes:
            for name, fn in programs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(target.params, *inputs[n]))
                times[name][n].append(time.perf_counter() - t0)
    out = {"n": sizes, "context": args.context, "rounds": args.rounds, "model": args.model,
           "machine": machine_info(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for name in programs:
        ms = [round(1e3 * statistics.median(times[name][n]), 3) for n in sizes]
        out[name] = {"ms": ms, "ratio_to_n1": [round(m / ms[0], 3) for m in ms]}
    out["ms"], out["ratio_to_n1"] = out["verify"]["ms"], out["verify"]["ratio_to_n1"]
    for name in programs:
        print(f"{name:16s} " + "  ".join(f"{n}:{m:.1f}ms/{r:.2f}x" for n, m, r in
                                       zip(sizes, out[name]["ms"], out[name]["ratio_to_n1"])))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
