"""Hardware-aware draft-tree budget: `hsd tune` measures; `generate(..., tuned=True)` reads the result.

Verification cost grows with the number of tree nodes at a rate that depends on the hardware
(compute-bound on a 2-core CPU, nearly flat up to ~64 nodes on accelerators), so the tree that
maximises tokens/s differs per machine. `tune` measures the target's verify cost for N new
tokens, then runs a grid of (nodes, depth, top-k) on training prompts (never the evaluation
suites) with the real drafter and picks the fastest; the choice is stored per hardware, target
and drafter in the user cache folder (`hsd_jax.tuning`).
"""
from __future__ import annotations

import statistics

from hsd_jax.engine import REUSE_POLICIES, SpecConfig
from hsd_jax.tuning import hardware_key, save_tuned


def verify_inputs(cfg, n: int, context: int, params=None):
    """(tokens, positions, cache, parents) of a verify of an n-token chain after `context` cached
    tokens, batch 1: what `verify_cost_curve` and benchmarks/verify_cost.py time; the cache in the
    dtype `generate` gives it over `params` (`llama.cache_dtype`; default the model's)."""
    import jax.numpy as jnp
    import numpy as np

    from hsd_jax.cache import init_cache
    from hsd_jax.models.layers import jnp_dtype
    from hsd_jax.models.llama import cache_dtype

    dtype = jnp_dtype(cfg) if params is None else cache_dtype(params, cfg)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, context + n + 64, cfg.head_dim, dtype)
    cache = cache.replace(lengths=jnp.array([context], jnp.int32))
    return (jnp.ones((1, n), jnp.int32), context + jnp.arange(n, dtype=jnp.int32)[None], cache,
            jnp.asarray(np.arange(n)[None] - 1, jnp.int32))


def verify_program(cfg, greedy: bool = True):
    """The target's part of a verify as `engine.target_verdict` runs it, jitted:
    f(params, tokens, positions, cache, parents, screen) -> (verdict, cache). Forward over the new
    tokens, then the head: at T = 0 (`greedy`) the argmax, from the bf16 screen where the engine
    builds one (the certified case, which is every row measured on real answers: `serving_argmax`
    falls back to the f32 head only for uncertified rows), else the f32 logits that sampling reads.
    The cache is donated and comes back written, its lengths unchanged: the write in place, as in the
    decode loop (a cache that is only an input is copied whole every call: at 1536 cached tokens
    ~10 ms of a ~17 ms SmolLM2 step). Call it through `in_place`."""
    import functools

    import jax

    from hsd_jax.models import llama

    @functools.partial(jax.jit, donate_argnums=(3,))
    def verify(params, tokens, positions, cache, parents, screen):
        out = llama.forward(params, cfg, tokens, positions, cache, parents)
        features, written = out.features, out.cache.replace(lengths=cache.lengths)
        if not greedy:
            return llama.serving_logits(params, cfg, features), written
        if screen is None:
            return llama.serving_argmax(params, cfg, features, None), written
        return llama.screened_argmax(params, cfg, features.reshape(-1, features.shape[-1]), screen), written   # with the check

    return verify


def in_place(program):
    """A program f(params, tokens, positions, cache, ...) -> (result, cache) that donates its cache
    (`verify_program`) as f(...) -> result: each cache a caller passes is copied once, on its first
    call, and every later call with it runs on the copy the previous call returned."""
    import jax
    import jax.numpy as jnp

    carried = {}

    def call(params, tokens, positions, cache, *rest):
        current = carried.pop(id(cache), None)
        if current is None:
            current = jax.tree.map(jnp.copy, cache)
        result, carried[id(cache)] = program(params, tokens, positions, current, *rest)
        return result

    return call


def verify_cost_curve(target, sizes=(1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64), context: int = 256,
                      repeats: int = 5, greedy: bool = True) -> dict[int, float]:
    """Milliseconds of one verify (`verify_program` over N new tree tokens) after `context` cached
    tokens; medians of rounds that interleave every N, so a passing slowdown hits all N alike."""
    from hsd_jax.api import serving_params
    from hsd_jax.bench import interleaved_ms
    from hsd_jax.models import llama

    cfg, params = target.config, serving_params(target, ready=True)   # as `generate` runs it (the CPU kernels included)
    verify = in_place(verify_program(cfg, greedy))
    inputs = {n: [(params, *verify_inputs(cfg, n, context, params), llama.head_screen(params, cfg, n) if greedy else None)]
              for n in sizes}
    return interleaved_ms({"verify": verify}, inputs, repeats)["verify"]


def candidate_trees(max_nodes: int = 64) -> list[dict]:
    """A small grid of draft trees up to max_nodes nodes: chains, and trees of branching 2, 4 and
    (for wide budgets) 8 that are at most k nodes wide per level on average."""
    grid = [dict(tree_nodes=d, tree_depth=d, tree_top_k=1) for d in range(1, 7) if d <= max_nodes]
    for depth in range(1, 7):
        for k in (2, 4, 8):
            for nodes in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
                most = k + (depth - 1) * k * k
                if (depth < nodes <= min(most, max_nodes) and nodes <= k * depth
                        and (k != 4 or nodes > 2 * depth) and (k != 8 or nodes >= 16)):
                    grid.append(dict(tree_nodes=nodes, tree_depth=depth, tree_top_k=k))
    return grid


def acceptance_by_depth(target, drafter, prompts, max_new_tokens: int = 64, depth: int = 4) -> list[float]:
    """P(draft token at depth d accepted | depths < d accepted) along a top-1 chain, d = 1..depth
    (greedy, all prompts in one batch: acceptance does not depend on batching)."""
    from hsd_jax.api import generate

    extra = {"reuse": "none"} if drafter.kind == "hsd" else {}
    res = generate(target, prompts, max_new_tokens=max_new_tokens, method=drafter.kind, drafter=drafter,
                   tree_nodes=depth, tree_depth=depth, tree_top_k=1, **extra)
    hist = [sum(r.stats["accepted_hist"][i] for r in res) for i in range(depth + 1)]
    reach = [sum(hist[d:]) for d in range(depth + 1)]
    return [round(reach[d] / reach[d - 1], 3) if reach[d - 1] else 0.0 for d in range(1, depth + 1)]


def _interleaved(target, prompts, max_new_tokens, variants: dict[str, dict]) -> dict[str, list[tuple]]:
    """(new tokens, rounds, seconds) per prompt for every variant, batch 1, run in turn on each prompt
    (A B C, A B C, ...) so machine drift cancels. Each variant first runs once untimed, so
    compilation and first-run costs stay out."""
    from hsd_jax.api import generate

    for kw in variants.values():
        generate(target, prompts[:1], max_new_tokens=max_new_tokens, **kw)
    per = {name: [] for name in variants}
    for p in prompts:
        for name, kw in variants.items():
            r = generate(target, [p], max_new_tokens=max_new_tokens, **kw)[0]
            per[name].append((r.stats["new_tokens"], r.stats["rounds"], r.stats["seconds"]))
    return per


def _summary(runs: list[tuple], ar_runs: list[tuple] | None = None) -> dict:
    """tau and tokens/s over per-prompt runs; with `ar_runs`, the median over prompts of the speedup."""
    new, rounds, secs = (sum(x) for x in zip(*runs))
    out = dict(tau=round((new - len(runs)) / max(rounds, 1), 3), tokens_per_s=round(new / secs, 2))
    if ar_runs is not None:
        out["speedup_vs_ar"] = round(statistics.median((a[2] / a[0]) / (m[2] / m[0]) for a, m in zip(ar_runs, runs)), 3)
    return out


def tune(target, drafter, prompts: list[list[int]], *, grid: list[dict] | None = None, max_new_tokens: int = 64,
         finalists: int = 4, lookup_slots: tuple[int, ...] = (0, 4),
         lookup_min_match: tuple[int, ...] = (SpecConfig.lookup_min_match,), curve: dict[int, float] | None = None,
         tuned_dir: str | None = None, log=print) -> dict:
    """Pick the tree (for HSD also the reuse policy, the number of prompt-lookup nodes and the
    shortest lookup match that adds them to a round) with
    the most tokens/s at batch 1, store it for this hardware, target and drafter
    (`hsd_jax.tuning`); returns the report.

    Stage 1 runs every tree of the grid on the first half of `prompts` (at least 2); stage 2
    reruns the `finalists` fastest trees (x every reuse policy for HSD, x every `lookup_slots`, the
    nonzero ones x every `lookup_min_match`: where verify rows are free, 0 wins)
    interleaved with ar on all `prompts`, and the median speedup over prompts decides. `curve`: a
    verify-cost curve already measured (`verify_cost_curve`), else it is measured first.
    `tuned_dir`: where the result goes (default: `tuning.cache_dir()`, where `generate(..., tuned=True)` looks)."""
    curve = curve or verify_cost_curve(target)
    log("verify cost (ms) by new tokens: " + ", ".join(f"{n}:{ms:.1f}" for n, ms in curve.items()))
    max_nodes = max(n for n, ms in curve.items() if ms <= 3 * curve[1]) - 1
    grid = grid or candidate_trees(max(max_nodes, 2))
    kw = dict(method=drafter.kind, drafter=drafter)
    first = prompts[: max(2, len(prompts) // 2)]
    log(f"stage 1: {len(grid)} trees up to {max(max_nodes, 2)} nodes on {len(first)} prompts")
    rows = []
    for tree in grid:
        rows.append(dict(tree, **_summary(_interleaved(target, first, max_new_tokens, {"tree": dict(kw, **tree)})["tree"])))
        log(f"{tree}: tau {rows[-1]['tau']:.2f}, {rows[-1]['tokens_per_s']:.1f} tok/s")
    keys = ("tree_nodes", "tree_depth", "tree_top_k")
    by_depth = acceptance_by_depth(target, drafter, prompts, max_new_tokens)
    log(f"acceptance by depth along the top-1 chain (all {len(prompts)} prompts): {by_depth}")
    top = [{k: r[k] for k in keys} for r in sorted(rows, key=lambda r: -r["tokens_per_s"])[:finalists]]
    policies = REUSE_POLICIES if drafter.kind == "hsd" else (None,)
    variants = {"ar": {}}
    for tree in top:
        for reuse in policies:
            for m in lookup_slots:
                for least in lookup_min_match if m else (None,):
                    name = ("/".join(str(tree[k]) for k in keys) + (f" {reuse}" if reuse else "")
                            + (f" +lookup{m}/{least}" if m else ""))
                    variants[name] = dict(kw, **tree, **({"reuse": reuse} if reuse else {}), lookup_slots=m,
                                          **({"lookup_min_match": least} if m else {}))
    log(f"stage 2: {len(variants) - 1} finalists interleaved with ar on {len(prompts)} prompts")
    runs = _interleaved(target, prompts, max_new_tokens, variants)
    final = {name: _summary(r, runs["ar"]) for name, r in runs.items()}
    for name, m in final.items():
        log(f"{name}: tau {m['tau']:.2f}, {m['tokens_per_s']:.1f} tok/s, {m['speedup_vs_ar']:.2f}x ar")
    best = max((n for n in final if n != "ar"), key=lambda n: final[n]["speedup_vs_ar"])
    choice = variants[best]
    report = {"hardware": hardware_key(), "tree": {k: choice[k] for k in keys},
              "expected_tokens_per_s": final[best]["tokens_per_s"], "ar_tokens_per_s": final["ar"]["tokens_per_s"],
              "expected_speedup": final[best]["speedup_vs_ar"], "verify_cost_ms": curve, "grid": rows,
              "finalists": final, "acceptance_by_depth": by_depth, "method": drafter.kind, "num_prompts": len(prompts),
              "max_new_tokens": max_new_tokens, "lookup_slots": choice["lookup_slots"]}
    if "reuse" in choice:
        report["reuse"] = choice["reuse"]
    if "lookup_min_match" in choice:
        report["lookup_min_match"] = choice["lookup_min_match"]
    report["path"] = save_tuned(report, target, drafter, tuned_dir)
    log(f"best: {best} at {final[best]['tokens_per_s']:.1f} tok/s vs ar {final['ar']['tokens_per_s']:.1f} tok/s "
        f"({final[best]['speedup_vs_ar']:.2f}x), tau {final[best]['tau']:.2f}")
    return report
