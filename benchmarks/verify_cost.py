"""The target's verify forward by number of new tokens N: what a draft tree of N slots costs
against one decode step (batch 1, a filled KV cache), all N interleaved round by round so a
machine's drift hits every N alike; medians.

Five programs per N, jitted as the engine runs them: `forward` (the layers, tree attention,
the cache write), `forward_xla_attention` (the same with XLA's tree attention where the CPU
kernel would serve it: the attention kernel's effect), `verify` (forward plus the greedy head, as `engine.target_verdict` at T = 0:
the certified bf16 screen where the engine builds one), `verify_f32_head` (forward plus the f32
logits sampling reads) and `verify_dot_head` (the f32 head as one dot, the form before
`llama.streams_head_rows`). Each donates its cache and gets it back written (`tune.in_place`):
the write in place, as the decode loop runs it, not a copy of the whole cache per call.

    python benchmarks/verify_cost.py --json benchmarks/results/cpu-2cores/verify_cost.json
"""
from __future__ import annotations

import argparse
import functools
import os
from unittest import mock

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the target's")
    ap.add_argument("--programs", default=None, help="comma-separated subset of the programs below (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-kernel", type=int, default=1, help="1: the layers as generate runs them (hsd_jax.cpu_kernels "
                    "where enabled); 0: XLA's dots")
    args = ap.parse_args()

    import jax

    from hsd_jax import cpu_kernels, load_target
    from hsd_jax.api import serving_params
    from hsd_jax.bench import interleaved_ms, machine_info, save_result
    from hsd_jax.models import llama
    from hsd_jax.tune import in_place, verify_inputs, verify_program

    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_target(args.model, tokenizer=False, dtype=args.dtype)
    cfg = target.config
    params = serving_params(target, ready=True) if args.cpu_kernel else target.params

    def forward(params, toks, pos, cache, parents, screen):
        out = llama.forward(params, cfg, toks, pos, cache, parents)
        return out.features, out.cache.replace(lengths=cache.lengths)

    def forward_xla_attention(params, toks, pos, cache, parents, screen):
        with mock.patch.object(cpu_kernels, "attention_supported", lambda *a: False):     # at trace time
            return forward(params, toks, pos, cache, parents, screen)

    def verify_dot_head(params, toks, pos, cache, parents, screen):
        features, cache = forward(params, toks, pos, cache, parents, screen)
        return llama.logits_from_features(params, cfg, features), cache

    donating = functools.partial(jax.jit, donate_argnums=(3,))   # the cache written in place, as in the decode loop
    programs = {"forward": donating(forward), "forward_xla_attention": donating(forward_xla_attention),
                "verify": verify_program(cfg), "verify_f32_head": verify_program(cfg, False),
                "verify_dot_head": donating(verify_dot_head)}
    if args.programs:
        programs = {name: programs[name] for name in args.programs.split(",")}
    inputs = {n: [(params, *verify_inputs(cfg, n, args.context, params), llama.head_screen(params, cfg, n))] for n in sizes}
    ms_by_name = interleaved_ms({name: in_place(fn) for name, fn in programs.items()}, inputs, args.rounds)
    out = {"n": sizes, "context": args.context, "dtype": args.dtype, "rounds": args.rounds, "model": args.model,
           "machine": machine_info(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "cpu_kernel": "packed_kernels" in params}
    for name in programs:
        ms = [ms_by_name[name][n] for n in sizes]
        out[name] = {"ms": ms, "ratio_to_n1": [round(m / ms[0], 3) for m in ms]}
    if "verify" in programs:
        out["ms"], out["ratio_to_n1"] = out["verify"]["ms"], out["verify"]["ratio_to_n1"]
    for name in programs:
        print(f"{name:16s} " + "  ".join(f"{n}:{m:.1f}ms/{r:.2f}x" for n, m, r in
                                       zip(sizes, out[name]["ms"], out[name]["ratio_to_n1"])))
    if args.json:
        save_result(out, args.json)


if __name__ == "__main__":
    main()
