"""`hsd bench`: methods side by side on real prompt suites, in one process.

For every batch of prompts each method runs in turn (A B C D, A B C D, ...) so machine
drift cancels; compilation and warm-up happen first and are reported separately.

JSON schema (`--json OUT`):
{
  "suite", "num_prompts", "batch_size", "temperature", "max_new_tokens", "repeats" (runs per batch
  and method, the fastest counted), "machine": {...},
  "methods": {
    "<name>": {
      "tau": committed tokens per verify round, bonus included (aggregate),
      "tokens_per_s": median over batches of new tokens / wall seconds,
      "speedup_vs_ar": median over batches of (ar seconds per token) / (method seconds per token),
      "identical_to_ar": true when every output equals ar's token for token (T = 0 only, else null),
      "prefix_match": {"mean", "min"} over prompts of the fraction of ar's tokens matched before the
                      first difference (T = 0 only; 1.0 when identical; bf16 near-ties can flip tokens),
      "drafter_forwards_per_token": sequential drafter calls per new token,
      "accepted_hist": rounds by number of accepted draft tokens,
      "new_tokens", "prompts" (run; fewer than asked when a deadline cut the run), "rounds",
      "lookup_rounds" (rounds that verified prompt-lookup nodes), "verify_rows_per_round" (rows
      the verify forward computed, root included; fewer than the tree's slots where skipped),
      "wall_seconds_per_call": {"median", "max"} of each timed call's wall time as a caller sees it
                               (encode, a new prompt bucket's prefill compile, transfers included),
      "wall_over_run": median over calls of wall time / (prefill + decode) time (1.0: nothing else),
      "compile_seconds" (the first call's), "options"
    }
  }
}
"""
from __future__ import annotations

import json
import os
import platform
import statistics
from typing import Callable

from hsd_jax.api import PROMPT_BUCKET
from hsd_jax.methods import METHODS, REGISTRY, TREE_METHODS

HSD_REUSE = {"hsd-noreuse": "none", "hsd-refresh": "refresh", "hsd-chain": "chain"}
METHOD_NAMES = METHODS + tuple(HSD_REUSE)
SPEC_OPTIONS = frozenset().union(*(m.options for m in REGISTRY.values()))   # every method's options
HYBRID_LOOKUP_SLOTS = 4   # "hsd+lookup": a tree method with this many prompt-lookup nodes ("hsd+lookup6": 6)
# "hsd+lookup6/0": those nodes in every round (`lookup_min_match` 0; without "/N": SpecConfig's default)
# "hsd~0.1", "hsd+lookup/2~0.1": draft nodes under that path probability pruned (`min_draft_prob`)


class BenchError(ValueError):
    """Invalid benchmark request."""


def method_spec(name: str) -> tuple[str, dict]:
    """(engine method, options) of a bench method name: a method, an hsd reuse variant
    (`hsd-chain`), or either with prompt-lookup nodes (`hsd+lookup`, `eagle+lookup6`), optionally
    with the shortest lookup match that adds them to a round (`hsd+lookup4/0`: every round), and
    any tree method with its draft nodes under a path probability pruned (`hsd~0.1`,
    `hsd+lookup/2~0.1`: `min_draft_prob`)."""
    head, tilde, floor = name.partition("~")
    if tilde:
        method, opts = method_spec(head)
        try:
            prob = float(floor)
        except ValueError:
            prob = -1.0
        if method not in TREE_METHODS or not 0 < prob < 1:
            raise BenchError(f"{name!r}: METHOD~P needs a tree method ({', '.join(TREE_METHODS)}) and 0 < P < 1")
        return method, dict(opts, min_draft_prob=prob)
    base, plus, extra = name.partition("+lookup")
    if plus:
        method, opts = method_spec(base)
        slots, slash, least = extra.partition("/")
        if (slots and not slots.isdigit()) or (slash and not least.isdigit()) or method not in TREE_METHODS:
            raise BenchError(f"{name!r}: METHOD+lookup[M][/N] needs a tree method ({', '.join(TREE_METHODS)}) "
                             "and whole numbers M (lookup nodes) and N (shortest lookup match)")
        opts = dict(opts, lookup_slots=int(slots or HYBRID_LOOKUP_SLOTS))
        return method, dict(opts, lookup_min_match=int(least)) if slash else opts
    if name not in METHOD_NAMES:
        raise BenchError(f"unknown method {name!r}; choose from {', '.join(METHOD_NAMES)}")
    if name in HSD_REUSE:
        return "hsd", {"reuse": HSD_REUSE[name]}
    return name, {}


def drafter_paths(items) -> dict[str, str]:
    """Repeated `--drafter KIND=PATH` flags as {kind: path}."""
    paths = {}
    for item in items:
        kind, _, path = item.partition("=")
        if kind not in REGISTRY or not path:
            raise BenchError(f"--drafter expects KIND=PATH with KIND one of {', '.join(REGISTRY)}, got {item!r}")
        paths[kind] = path
    return paths


def make_runner(target, name: str, drafter=None, *, options: dict | None = None, temperature: float = 0.0,
                max_new_tokens: int = 128, seed: int = 0, mesh=None, prompt_bucket: int = PROMPT_BUCKET) -> Callable:
    """A callable(batch of token-id prompts) -> list[GenerationResult] for one method.

    options: speculative options for every method (tree_* for tree methods, gamma for chain
    methods, tuned=True); each method takes the ones it reads."""
    from hsd_jax.api import generate

    method, forced = method_spec(name)
    options = dict(options or {})
    if method == "ar":
        options = {}
    else:
        unread = SPEC_OPTIONS - REGISTRY[method].options
        options = {k: v for k, v in options.items() if k not in unread}
        options.update(forced)

    def run(ids):
        return generate(target, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                        method=method, drafter=drafter, mesh=mesh, prompt_bucket=prompt_bucket, **options)

    run.options = options
    return run


def machine_info() -> dict:
    import jax

    from hsd_jax import cpu_kernels

    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
            "devices": jax.device_count(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "jax": jax.__version__, "cpu_kernel": cpu_kernels.enabled(),   # f32 targets without a mesh use it
            "amx_tiles": cpu_kernels.amx_tiles()}


def interleaved_ms(programs: dict[str, Callable], inputs: dict, rounds: int) -> dict[str, dict]:
    """Median milliseconds of each program at each size: {name: {n: ms}}. `inputs[n]` is a list of
    argument tuples, cycled by round; every (n, program) runs once per round, so a passing slowdown
    of the machine hits all of them alike. Each is compiled and warmed up first."""
    import time

    import jax

    for args in inputs.values():
        for fn in programs.values():
            jax.block_until_ready(fn(*args[0]))
    times = {name: {n: [] for n in inputs} for name in programs}
    for r in range(rounds):
        for n, args in inputs.items():
            for name, fn in programs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args[r % len(args)]))
                times[name][n].append(time.perf_counter() - t0)
    return {name: {n: round(statistics.median(t) * 1e3, 3) for n, t in by_n.items()} for name, by_n in times.items()}


def run_bench(runners: dict[str, Callable], prompts: list[list[int]], *, batch_size: int = 1,
              temperature: float = 0.0, progress: bool = True, deadline: float | None = None,
              repeats: int = 1) -> dict:
    """Run every method on every batch of prompts, interleaved; returns the per-method summary.

    repeats: runs of every method on each batch (interleaved too), of which the fastest counts:
    a batch's time without the machine's own pauses (the outputs are the same every run).
    deadline: a `time.time()` after which no new batch starts (time-boxed runs); the summary
    then covers the batches run so far, counted in each method's `prompts`."""
    import time

    from tqdm import tqdm

    from hsd_jax import distributed

    if "ar" not in runners:
        raise BenchError("the ar baseline must be among the methods (speedups are measured against it)")
    if batch_size < 1 or not prompts or repeats < 1:
        raise BenchError("need batch_size >= 1, repeats >= 1 and at least one prompt")
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    compile_s = {}
    for name, run in runners.items():
        res = run(batches[0])
        compile_s[name] = res[0].stats["compile_seconds"]
    per = {name: {"tokens": [], "seconds": [], "outputs": [], "rounds": 0, "dsteps": 0, "lookup_rounds": 0, "vslots": 0,
                  "hist": [], "wall": [], "wall_ratio": []}
           for name in runners}
    bar = tqdm(total=len(batches) * len(runners) * repeats, desc="bench", unit="run",
               disable=not (progress and distributed.is_primary()))
    for batch in batches:
        if deadline is not None and per["ar"]["tokens"] and distributed.agree(time.time() > deadline):
            break   # process 0's clock decides: every process must run the same batches
        fastest = {}
        for _ in range(repeats):
            for name, run in runners.items():
                t0 = time.perf_counter()
                res = run(batch)
                wall = time.perf_counter() - t0
                per[name]["wall"].append(wall)
                per[name]["wall_ratio"].append(wall / max(res[0].stats["seconds"], 1e-9))
                if name not in fastest or res[0].stats["seconds"] < fastest[name][0].stats["seconds"]:
                    fastest[name] = res
                bar.update(1)
        for name, res in fastest.items():
            rec = per[name]
            rec["tokens"].append(sum(r.stats["new_tokens"] for r in res))
            rec["seconds"].append(res[0].stats["seconds"])
            rec["outputs"].extend(r.token_ids for r in res)
            rec["rounds"] += sum(r.stats["rounds"] for r in res)
            rec["dsteps"] += sum(r.stats["drafter_forwards"] for r in res)
            rec["lookup_rounds"] += sum(r.stats.get("lookup_rounds", 0) for r in res)
            rec["vslots"] += sum(r.stats.get("verified_slots", r.stats["rounds"]) for r in res)
            for r in res:
                h = r.stats["accepted_hist"]
                rec["hist"] = [a + b for a, b in zip(rec["hist"], h)] if rec["hist"] else list(h)
    bar.close()
    ar = per["ar"]
    out = {}
    for name, rec in per.items():
        new = sum(rec["tokens"])
        committed = new - len(rec["outputs"])
        spt = [s / max(t, 1) for s, t in zip(rec["seconds"], rec["tokens"])]
        ar_spt = [s / max(t, 1) for s, t in zip(ar["seconds"], ar["tokens"])]
        out[name] = {
            "tau": round(committed / rec["rounds"], 4) if rec["rounds"] else 1.0,
            "tokens_per_s": round(statistics.median(t / s for t, s in zip(rec["tokens"], rec["seconds"])), 3),
            "speedup_vs_ar": round(statistics.median(a / m for a, m in zip(ar_spt, spt)), 4),
            "identical_to_ar": (rec["outputs"] == ar["outputs"]) if temperature == 0 else None,
            "prefix_match": prefix_match(rec["outputs"], ar["outputs"]) if temperature == 0 else None,
            "drafter_forwards_per_token": round(rec["dsteps"] / max(new, 1), 4),
            "accepted_hist": rec["hist"],
            "new_tokens": new,
            "prompts": len(rec["outputs"]),
            "rounds": rec["rounds"],
            "lookup_rounds": rec["lookup_rounds"],
            "verify_rows_per_round": round(rec["vslots"] / rec["rounds"], 3) if rec["rounds"] else 1.0,
            "wall_seconds_per_call": {"median": round(statistics.median(rec["wall"]), 4),
                                      "max": round(max(rec["wall"]), 4)} if rec["wall"] else None,
            "wall_over_run": round(statistics.median(rec["wall_ratio"]), 3) if rec["wall_ratio"] else None,
            "compile_seconds": round(compile_s[name], 2),
            "options": getattr(runners[name], "options", {}),
        }
    return out


def save_result(result: dict, path: str) -> None:
    """Write a bench result as JSON (its folder made as needed); in a multi-process run only process 0 writes."""
    from hsd_jax.distributed import is_primary

    if is_primary():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def prefix_match(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Mean and min over sequences of the share of `reference` matched before the first difference."""
    fracs = []
    for out, ref in zip(outputs, reference):
        n = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        fracs.append(1.0 if out == ref else n / max(len(ref), 1))
    return {"mean": round(sum(fracs) / max(len(fracs), 1), 4), "min": round(min(fracs, default=1.0), 4)}


def format_table(methods: dict) -> str:
    """A markdown table of the summary."""
    rows = ["| method | tau | tokens/s | speedup vs ar | identical to ar | drafter fwd / token | wall s/call "
            "(median, max) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in methods.items():
        wall = m.get("wall_seconds_per_call")
        wall = f"{wall['median']:.2f}, {wall['max']:.2f}" if wall else "-"
        rows.append(f"| {name} | {m['tau']:.2f} | {m['tokens_per_s']:.1f} | {m['speedup_vs_ar']:.2f}x | "
                    f"{m['identical_to_ar']} | {m['drafter_forwards_per_token']:.2f} | {wall} |")
    return "\n".join(rows)


def plot(result: dict, path: str) -> None:
    """Speedup and tau per method, and each method's accepted-length histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    names = list(methods)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(names, [methods[n]["speedup_vs_ar"] for n in names], color="tab:blue")
    axes[0].axhline(1.0, color="gray", lw=1)
    axes[0].set_title("speedup vs ar (median)")
    axes[1].bar(names, [methods[n]["tau"] for n in names], color="tab:green")
    axes[1].set_title("tau (tokens per target forward)")
    for n in names:
        h = methods[n]["accepted_hist"]
        if n != "ar" and sum(h):
            axes[2].plot(range(len(h)), [x / sum(h) for x in h], marker="o", label=n)
    axes[2].set_title("accepted draft tokens per round")
    axes[2].set_xlabel("accepted")
    axes[2].legend()
    fig.suptitle(f"{result['suite']}: {result['num_prompts']} prompts, batch {result['batch_size']}, "
                 f"T={result['temperature']}, {result['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
