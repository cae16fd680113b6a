"""The greedy verify head with and without the bf16 screen (`llama.serving_argmax`), side by side.

1. Certification: the share of real target features (every answer position of MT-bench prompts'
   greedy answers) whose argmax the screen certifies, and the share of verify-sized batches of N
   consecutive positions that need no f32 fallback.
2. Head alone, N rows interleaved, medians, cycling through blocks of those features (so the
   fallbacks count as often as they occur): the f32 streamed head + argmax (`serving_argmax`
   without a screen) against the screened one; and the whole verify (forward + head) over a
   chain of N real answer tokens after a real context, as the engine runs it.
3. End to end: `generate` with `head_screen` on and off, interleaved per prompt, T = 0, batch 1:
   tokens/s and identical outputs.

    python benchmarks/head_screen.py --json benchmarks/results/cpu-2cores/head_screen.json
"""
from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sizes", default="3,5,9,13")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--method", default="hsd")
    ap.add_argument("--trees", default="8,4,3;2,2,1", help="nodes,depth,top-k of the end-to-end runs, ';'-separated ('' skips them)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from hsd_jax import generate, load_drafter, load_target
    from hsd_jax.bench import interleaved_ms, machine_info
    from hsd_jax.cache import init_cache
    from hsd_jax.models import llama
    from hsd_jax.prompts import load_suite

    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_target()
    cfg, params = target.config, target.params
    ids = [target.encode(p, chat=True) for p in load_suite("mt_bench", args.num_prompts)]
    answers = generate(target, ids, max_new_tokens=args.max_new_tokens)

    feats = []
    for p, r in zip(ids, answers):
        seq = jnp.asarray([p + r.token_ids], jnp.int32)
        cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, seq.shape[1] + 16, cfg.head_dim)
        _, out = llama.forward_logits(params, cfg, seq, jnp.arange(seq.shape[1])[None], cache)
        feats.append(np.asarray(out.features[0, len(p) - 1:]))
    feats = np.concatenate(feats)
    screen = jax.jit(llama.head_screen, static_argnums=(1, 2))(params, cfg, max(sizes))
    screened = jax.jit(llama.screened_argmax, static_argnums=1)
    f32_argmax = jax.jit(lambda p, f: llama.serving_argmax(p, cfg, f, None))
    certified, agree = [], []
    for i in range(0, len(feats) - 31, 32):
        f = jnp.asarray(feats[i:i + 32])
        tok, ok = screened(params, cfg, f, screen)
        ref = f32_argmax(params, f)
        certified.append(np.asarray(ok))
        agree.append(np.asarray(tok == ref)[np.asarray(ok)])
    certified = np.concatenate(certified)
    batches = {n: float(np.mean([certified[i:i + n].all() for i in range(0, len(certified) - n + 1, n)])) for n in sizes}
    report = {"machine": machine_info(), "positions": int(len(certified)),
              "certified_rows": round(float(certified.mean()), 4),
              "certified_rows_agree_with_f32": bool(np.concatenate(agree).all()),
              "batches_without_fallback": {n: round(v, 4) for n, v in batches.items()}}
    print(json.dumps(report, indent=1), flush=True)

    # 2. The head alone, and verify (forward + head) on a real context with real next tokens.
    starts = np.linspace(0, len(feats) - max(sizes), args.rounds).astype(int)
    blocks = {n: [(jnp.asarray(feats[i:i + n]),) for i in starts] for n in sizes}
    screened_head = jax.jit(lambda p, f, s: llama.serving_argmax(p, cfg, f, s))
    heads = {"f32": lambda f: f32_argmax(params, f), "screen": lambda f: screened_head(params, f, screen)}
    report["head_ms"] = interleaved_ms(heads, blocks, args.rounds)
    print("head ms", report["head_ms"], flush=True)

    seq = ids[0] + answers[0].token_ids
    ctx = len(ids[0]) + 16
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, ctx + max(sizes) + 64, cfg.head_dim)
    cache = llama.prefill(params, cfg, jnp.asarray([seq[:ctx]]), jnp.asarray([ctx]), cache)[1].cache
    chains = {n: [(jnp.asarray([seq[ctx:ctx + n]]), ctx + jnp.arange(n)[None], jnp.arange(n)[None] - 1)]
              for n in sizes}

    def verify(use_screen):
        @jax.jit
        def run(p, toks, pos, parents, kv, s):
            out = llama.forward(p, cfg, toks, pos, kv, parents)
            one_row = toks.shape[1] == 1       # a decode step: the engine never screens one row
            return llama.serving_argmax(p, cfg, out.features, None if one_row or not use_screen else s)
        return lambda *a: run(params, *a, cache, screen)

    chains[1] = [(jnp.asarray([seq[ctx:ctx + 1]]), jnp.asarray([[ctx]]), jnp.asarray([[-1]]))]
    report["verify_ms"] = interleaved_ms({"f32": verify(False), "screen": verify(True)}, chains, args.rounds)
    report["verify_ratio_to_n1"] = {k: {n: round(ms / v[1], 3) for n, ms in v.items()} for k, v in report["verify_ms"].items()}
    print("verify ms", report["verify_ms"], report["verify_ratio_to_n1"], flush=True)
    if not args.trees:
        return finish(report, args.json)

    # 3. End to end, per tree.
    drafter = load_drafter(args.method, target=target)
    report["end_to_end"] = []
    for tree in args.trees.split(";"):
        nodes, depth, top_k = (int(x) for x in tree.split(","))
        opts = dict(method=args.method, drafter=drafter, tree_nodes=nodes, tree_depth=depth, tree_top_k=top_k,
                    max_new_tokens=args.max_new_tokens)
        for on in (True, False):                         # compile both
            generate(target, ids[:1], head_screen=on, **opts)
        tok_s, identical = {True: [], False: []}, True
        for p, ref in zip(ids, answers):
            for on in (True, False):
                r = generate(target, [p], head_screen=on, **opts)[0]
                tok_s[on].append(r.stats["tokens_per_s"])
                identical &= r.token_ids == ref.token_ids
        row = {"method": args.method, "tree": tree, "prompts": len(ids),
               "tok_s_screen": round(statistics.mean(tok_s[True]), 2), "tok_s_f32": round(statistics.mean(tok_s[False]), 2),
               "ratio": round(statistics.mean(tok_s[True]) / statistics.mean(tok_s[False]), 3), "identical_to_ar": identical}
        report["end_to_end"].append(row)
        print(row, flush=True)
    finish(report, args.json)


def finish(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
