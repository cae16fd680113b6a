"""The target's layer loop on XLA:CPU: `lax.scan` over stacked weights (as shipped) against an
unrolled loop over per-layer weight buffers, isolated and inside `generate`.

`benchmarks/op_profile.py` shows that for 2+ rows each layer's MLP weights are first copied out
of the stacked [L, ...] arrays (a dynamic-slice per matrix and layer) before the GEMM, while one
row fuses the slice into its GEMV. Per-layer buffers need no slice at all. This script measures
whether that pays: the forward alone (N = 1, 4, 8 new tokens at a given context, interleaved,
medians) and end to end (ar, lookup and hsd on suite prompts, compile time included), with
the experimental forward swapped in for the run only. Outputs are checked identical to ar.

    python benchmarks/layer_loop.py --context 768 --suite spec_bench:summarization --num-prompts 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

from hsd_jax import api, generate, load_drafter, load_target
from hsd_jax.cache import init_cache
from hsd_jax.models import llama
from hsd_jax.prompts import load_suite

SCAN = llama.forward_embeddings


def unrolled(params, cfg, x, positions, cache, parents=None):
    """`llama.forward_embeddings` over params["layer_list"] (one weight dict per layer), unrolled."""
    if "layer_list" not in params:
        return SCAN(params, cfg, x, positions, cache, parents)
    layer, ck, cv, outs = llama.DecoderLayer(cfg), cache.k, cache.v, []
    for i, p in enumerate(params["layer_list"]):
        x, ck, cv = layer.apply({"params": p}, x, positions, ck, cv, i, cache.lengths, parents)
        outs.append(x)
    aux = jnp.stack([outs[j] for j in cfg.feature_layers]) if cfg.feature_layers else jnp.zeros((0,) + x.shape, x.dtype)
    return llama.ForwardOutput(x, aux, cache.replace(k=ck, v=cv))


def with_layer_list(params, num_layers):
    return dict(params, layer_list=tuple(jax.tree.map(lambda a, i=i: jnp.array(a[i]), params["layers"])
                                         for i in range(num_layers)))


def isolated(target, context, sizes=(1, 4, 8), rounds=12):
    cfg = target.config
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, target.max_cache_len, cfg.head_dim)
    cache = cache.replace(lengths=jnp.array([context], jnp.int32))
    split = with_layer_list(target.params, cfg.num_layers)
    runs = {}
    for name, params in (("scan", target.params), ("unrolled", split)):
        fwd = jax.jit(lambda p, t, pos, c, par: unrolled(p, cfg, llama.embed(p, t), pos, c, par).features)
        for n in sizes:
            tokens = jnp.arange(n, dtype=jnp.int32)[None] + 5
            pos = context + jnp.arange(n, dtype=jnp.int32)[None]
            parents = None if n == 1 else jnp.arange(n, dtype=jnp.int32)[None] - 1
            t0 = time.perf_counter()
            exe = fwd.lower(params, tokens, pos, cache, parents).compile()
            runs[(name, n)] = (exe, (params, tokens, pos, cache, parents), time.perf_counter() - t0, [])
    for _ in range(rounds):
        for exe, args, _, ts in runs.values():
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*args))
            ts.append(time.perf_counter() - t0)
    for (name, n), (_, _, compile_s, ts) in runs.items():
        ms = statistics.median(ts) * 1e3
        base = statistics.median(runs[(name, sizes[0])][3]) * 1e3
        print(f"forward {name:9s} N={n}: {ms:6.1f} ms ({ms / base:.2f}x N={sizes[0]}), compile {compile_s:.1f} s")


def end_to_end(target, suite, num_prompts, max_new_tokens):
    prompts = [target.encode(p, chat=True) for p in load_suite(suite, num_prompts)]
    hsd = load_drafter("hsd", target=target)
    methods = {"ar": {}, "lookup": dict(method="lookup", drafter=load_drafter("lookup", target=target), gamma=6),
               "hsd 3/3/1": dict(method="hsd", drafter=hsd, tree_nodes=3, tree_depth=3, tree_top_k=1),
               "hsd 3/3/1+lookup4": dict(method="hsd", drafter=hsd, tree_nodes=3, tree_depth=3, tree_top_k=1,
                                         lookup_slots=4)}
    stacked = target.params
    split = with_layer_list(stacked, target.config.num_layers)
    res = {}
    for layout, params in (("scan", stacked), ("unrolled", split)):
        target.params = params
        api._COMPILED.clear()
        jax.clear_caches()
        for m, kw in methods.items():
            compile_s = generate(target, prompts[:1], max_new_tokens=8, **kw)[0].stats["compile_seconds"]
            res[(layout, m)] = {"compile": compile_s, "seconds": 0.0, "tokens": 0, "ids": []}
    for p in prompts:       # interleaved: every layout and method per prompt
        for layout, params in (("scan", stacked), ("unrolled", split)):
            target.params = params
            for m, kw in methods.items():
                r = generate(target, [p], max_new_tokens=max_new_tokens, **kw)[0]
                rec = res[(layout, m)]
                rec["seconds"] += r.stats["seconds"]
                rec["tokens"] += r.stats["new_tokens"]
                rec["ids"].append(r.token_ids)
    target.params = stacked
    ref = res[("scan", "ar")]["ids"]
    for (layout, m), rec in res.items():
        print(f"generate {layout:9s} {m:18s} {rec['tokens'] / rec['seconds']:6.2f} tok/s, compile "
              f"{rec['compile']:.1f} s, identical to ar: {rec['ids'] == ref}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--max-cache-len", type=int, default=2048)
    ap.add_argument("--suite", default="spec_bench:summarization")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    os.environ["HSD_CPU_KERNELS"] = "0"     # XLA's dots on both sides, as measured before hsd_jax.cpu_kernels
    llama.forward_embeddings = unrolled     # falls back to the scan unless params carry "layer_list"
    target = load_target("smollm2-135m", max_cache_len=args.max_cache_len)
    isolated(target, args.context)
    end_to_end(target, args.suite, args.num_prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
