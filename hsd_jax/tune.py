"""Hardware-aware draft-tree budget: `hsd tune` measures, `generate` and `bench` read the result.

Verification cost grows with the number of tree nodes at a rate that depends on the hardware
(compute-bound on a 2-core CPU, nearly flat up to ~64 nodes on accelerators), so the tree that
maximises tokens/s differs per machine. `tune` measures the target's verify cost for N new
tokens, then runs a grid of (nodes, depth, top-k) on training prompts (never the evaluation
suites) with the real drafter and picks the fastest; the choice is stored per hardware key in
`hsd_jax/tuned/<key>.json`.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import time

TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
DEFAULT_TREES = {
    "cpu": dict(tree_nodes=8, tree_depth=4, tree_top_k=3),
    "gpu": dict(tree_nodes=48, tree_depth=6, tree_top_k=8),
    "tpu": dict(tree_nodes=48, tree_depth=6, tree_top_k=8),
}


def hardware_key() -> str:
    """e.g. `cpu-2cores`, `gpu-nvidia-h200`, `tpu-tpu-v5-lite`."""
    import jax

    backend = jax.default_backend()
    if backend == "cpu":
        return f"cpu-{os.cpu_count()}cores"
    kind = getattr(jax.devices()[0], "device_kind", backend)
    return f"{backend}-" + re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def load_tuned(key: str | None = None) -> dict | None:
    path = os.path.join(TUNED_DIR, f"{key or hardware_key()}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def default_tree() -> dict:
    """The tuned tree for this hardware, else the backend's default."""
    import jax

    tuned = load_tuned()
    if tuned:
        return dict(tuned["tree"])
    return dict(DEFAULT_TREES.get(jax.default_backend(), DEFAULT_TREES["gpu"]))


def tree_options(nodes: int | None = None, depth: int | None = None, top_k: int | None = None) -> dict:
    """Tree options with anything not given taken from `default_tree()`."""
    tree = default_tree()
    for name, v in (("tree_nodes", nodes), ("tree_depth", depth), ("tree_top_k", top_k)):
        if v is not None:
            tree[name] = int(v)
    return tree


def verify_cost_curve(target, sizes=(1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64), context: int = 256,
                      repeats: int = 5) -> dict[int, float]:
    """Milliseconds of one target forward over N new tree tokens after `context` cached tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hsd_jax.cache import init_cache
    from hsd_jax.models import llama

    cfg = target.config
    fwd = jax.jit(llama.forward, static_argnums=1)
    out = {}
    for n in sizes:
        cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, context + n + 64, cfg.head_dim,
                           jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32)
        cache = cache.replace(lengths=jnp.array([context], jnp.int32))
        toks = jnp.ones((1, n), jnp.int32)
        parents = jnp.asarray(np.arange(n)[None] - 1, jnp.int32)
        pos = context + jnp.arange(n, dtype=jnp.int32)[None]
        jax.block_until_ready(fwd(target.params, cfg, toks, pos, cache, parents))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fwd(target.params, cfg, toks, pos, cache, parents))
            ts.append(time.perf_counter() - t0)
        out[n] = round(statistics.median(ts) * 1e3, 3)
    return out


def candidate_trees(max_nodes: int = 64) -> list[dict]:
    """A small grid of valid (nodes, depth, top-k) trees up to max_nodes draft nodes."""
    grid = []
    for depth in (2, 3, 4, 5, 6):
        for k in (1, 2, 3, 4, 8):
            for nodes in (2, 4, 6, 8, 12, 16, 24, 32, 48, 64):
                most = k + (depth - 1) * k * k
                if depth <= nodes <= min(most, max_nodes) and (k > 1 or nodes == depth):
                    grid.append(dict(tree_nodes=nodes, tree_depth=depth, tree_top_k=k))
    return grid


def tune(target, drafter, prompts: list[list[int]], *, grid: list[dict] | None = None, max_new_tokens: int = 64,
         log=print) -> dict:
    """Measure, pick the fastest tree, write `hsd_jax/tuned/<hardware>.json`; returns the report."""
    from hsd_jax.api import generate

    curve = verify_cost_curve(target)
    log("verify cost (ms) by new tokens: " + ", ".join(f"{n}:{ms:.1f}" for n, ms in curve.items()))
    max_nodes = max(n for n, ms in curve.items() if ms <= 3 * curve[1]) - 1
    grid = grid or candidate_trees(max(max_nodes, 2))
    rows = []
    for tree in grid:
        generate(target, prompts[:1], max_new_tokens=8, method=drafter.kind, drafter=drafter, **tree)
        res = generate(target, prompts, max_new_tokens=max_new_tokens, method=drafter.kind, drafter=drafter, **tree)
        new = sum(r.stats["new_tokens"] for r in res)
        rounds = sum(r.stats["rounds"] for r in res)
        tps = new / res[0].stats["seconds"]
        rows.append(dict(tree, tau=round((new - len(res)) / max(rounds, 1), 3), tokens_per_s=round(tps, 2)))
        log(f"{tree}: tau {rows[-1]['tau']:.2f}, {tps:.1f} tok/s")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    ar = generate(target, prompts, max_new_tokens=max_new_tokens)
    ar_tps = sum(r.stats["new_tokens"] for r in ar) / ar[0].stats["seconds"]
    report = {"hardware": hardware_key(), "tree": {k: best[k] for k in ("tree_nodes", "tree_depth", "tree_top_k")},
              "expected_tokens_per_s": best["tokens_per_s"], "ar_tokens_per_s": round(ar_tps, 2),
              "verify_cost_ms": curve, "grid": rows, "drafter": drafter.path, "method": drafter.kind}
    os.makedirs(TUNED_DIR, exist_ok=True)
    with open(os.path.join(TUNED_DIR, f"{report['hardware']}.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(f"best: {report['tree']} at {best['tokens_per_s']:.1f} tok/s (ar {ar_tps:.1f} tok/s), tau {best['tau']:.2f}")
    return report
