"""Time split of one speculative round on SmolLM2-135M: draft / verify / accept+commit / drafter update.

Each public step function is jitted on its own and timed after warm-up (median of repeats);
`generate`'s compile time is reported too. Random drafters by default (`--shipped` for the trained
one): the split, not acceptance, is the point.

    python benchmarks/round_split.py --method hsd --tree-nodes 10 --tree-depth 4 --top-k 4
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp


def _time(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="hsd", choices=["hsd", "eagle"])
    ap.add_argument("--tree-nodes", type=int, default=10)
    ap.add_argument("--tree-depth", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--shipped", action="store_true", help="the shipped trained drafter instead of a random one")
    args = ap.parse_args()

    from hsd_jax import engine, generate, load_drafter, load_target
    from hsd_jax.cache import init_cache
    from hsd_jax.config import SamplingConfig
    from hsd_jax.methods import eagle as eagle_m
    from hsd_jax.methods import hsd as hsd_m
    from hsd_jax.models import drafter as dmod
    from hsd_jax.prompts import load_suite
    from hsd_jax.verify import accept

    target = load_target("smollm2-135m", max_cache_len=1024)
    drafter = (load_drafter(args.method, target=target) if args.shipped else
               load_drafter(args.method, target=target, random_init=True, draft_vocab_size=args.draft_vocab))
    spec = engine.SpecConfig(method=args.method, reuse="none", tree_nodes=args.tree_nodes,
                             tree_depth=args.tree_depth, tree_top_k=args.top_k)
    tcfg, dcfg = target.config, drafter.config
    ids = target.encode(load_suite("mt_bench", 1)[0], chat=True)
    r = generate(target, [ids], max_new_tokens=32, method=args.method, drafter=drafter, tree_nodes=args.tree_nodes,
                 tree_depth=args.tree_depth, tree_top_k=args.top_k, reuse="none")[0]
    print(f"generate compile: {r.stats['compile_seconds']:.1f} s; run {r.stats['seconds']:.2f} s "
          f"for {r.stats['new_tokens']} tokens")

    cap, b = 512, 1
    tokens = jnp.asarray([ids], jnp.int32)
    lens = jnp.asarray([len(ids)], jnp.int32)
    tcache = init_cache(tcfg.num_layers, b, tcfg.num_kv_heads, cap, tcfg.head_dim)
    _, out = jax.jit(engine.prefill, static_argnums=1)(target.params, tcfg, tokens, lens, tcache)
    tcache = out.cache
    view = jax.jit(dmod.target_view, static_argnums=1)(target.params, tcfg, drafter.d2t)
    lcfg = dcfg.layer_config()
    dcache = init_cache(lcfg.num_layers, b, lcfg.num_kv_heads, cap, lcfg.head_dim).replace(lengths=lens)
    root = jnp.asarray([ids[-1]], jnp.int32)
    chain = jnp.zeros((b, spec.tree_depth, tcfg.hidden_size)) + out.features[:, len(ids) - 1][:, None]
    sampling = SamplingConfig()

    if args.method == "hsd":
        draft = jax.jit(functools.partial(hsd_m.tree_from_chain, dcfg=dcfg, spec=spec))
        draft_ms = _time(lambda: draft(drafter.params, view=view, chain=chain, root_tokens=root))
        tree = draft(drafter.params, view=view, chain=chain, root_tokens=root)
    else:
        draft = jax.jit(lambda dp, view, cache, root_g, root: eagle_m.tree_from_root(
            eagle_m.ops(dp, dcfg, view), cache, root_g, root, spec, view.d2t))
        draft_ms = _time(lambda: draft(drafter.params, view, dcache, chain[:, 0], root))
        tree, _ = draft(drafter.params, view, dcache, chain[:, 0], root)
    from hsd_jax.models import llama

    @jax.jit
    def verify(params, cache, tree):
        vout = engine.verify_tree(params, tcfg, cache, tree)
        return llama.serving_logits(params, tcfg, vout.features), vout

    verify_ms = _time(lambda: verify(target.params, tcache, tree))
    logits, vout = verify(target.params, tcache, tree)

    @jax.jit
    def accept_commit(tree, logits, cache):
        acc = accept(tree, logits, jax.random.key(0), sampling)
        return acc, engine.commit(cache, acc, jnp.ones((b,), bool))

    ac_ms = _time(lambda: accept_commit(tree, logits, vout.cache))
    acc, _ = accept_commit(tree, logits, vout.cache)
    if args.method == "hsd":
        upd = jax.jit(functools.partial(hsd_m.rebuild_chain, dcfg=dcfg, reuse="none"))
        upd_ms = _time(lambda: upd(drafter.params, cache=dcache, chain=chain, acc=acc, feats=vout.features,
                                   aux=vout.aux_features, live=jnp.ones((b,), bool)))
    else:
        upd = jax.jit(lambda dp, view, cache, tree, acc, vout: eagle_m.ingest_accepted(
            eagle_m.ops(dp, dcfg, view), cache, tree, acc, vout, jnp.ones((b,), bool)))
        upd_ms = _time(lambda: upd(drafter.params, view, dcache, tree, acc, vout))
    total = draft_ms + verify_ms + ac_ms + upd_ms
    print(f"\n{args.method}: N={args.tree_nodes} D={args.tree_depth} K={args.top_k} V_d={dcfg.draft_vocab_size}, batch 1, f32")
    print("| step | ms | share |\n| --- | --- | --- |")
    for name, ms in [("draft (tree read-outs)", draft_ms), ("verify (target forward)", verify_ms),
                     ("accept + commit", ac_ms), ("drafter update (ingest + chain)", upd_ms)]:
        print(f"| {name} | {ms:.2f} | {100 * ms / total:.0f}% |")
    print(f"| round (separately jitted) | {total:.2f} | |")


if __name__ == "__main__":
    main()
