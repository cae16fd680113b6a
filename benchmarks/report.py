"""Markdown tables for BENCHMARKS.md from a folder of `hsd bench` / acceptance JSON results.

    python benchmarks/report.py benchmarks/results/cpu-2cores > report.md
    python benchmarks/report.py --hybrid benchmarks/results/cpu-2cores/lookup_hybrid   # + hybrid.png
"""
from __future__ import annotations

import glob
import json
import os
import sys


def _load(folder: str) -> dict[str, dict]:
    return {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "*.json")))}


def bench_table(r: dict) -> str:
    ar = r["methods"]["ar"]
    rows = [f"{r['suite']}, {r['num_prompts']} prompts, T={r['temperature']}, batch {r['batch_size']}, "
            f"{r['max_new_tokens']} new tokens, tree {r['tree']}, sd gamma {r['gamma']}", "",
            "| method | tau | tokens/s | speedup vs ar | identical to ar | drafter fwd / token | ms / round "
            "| compile s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in r["methods"].items():
        total_s = m["new_tokens"] / m["tokens_per_s"] if m["tokens_per_s"] else 0.0
        ms_round = 1e3 * total_s / max(m["rounds"], 1) if name != "ar" else 1e3 / ar["tokens_per_s"]
        same = {True: "yes", False: "**no**", None: "n/a (T>0)"}[m["identical_to_ar"]]
        rows.append(f"| {name} | {m['tau']:.2f} | {m['tokens_per_s']:.1f} | {m['speedup_vs_ar']:.2f}x | {same} | "
                    f"{m['drafter_forwards_per_token']:.2f} | {ms_round:.0f} | {m['compile_seconds']:.1f} |")
    return "\n".join(rows)


def matrix_table(results: dict[str, dict]) -> str:
    runs = [r for k, r in results.items() if "methods" in r and "headline" not in k and "acceptance" not in k]
    if not runs:
        return ""
    names = [n for n in runs[0]["methods"] if n != "ar"]
    head = "| suite | T | batch | ar tok/s | " + " | ".join(f"{n}: tau / speedup" for n in names) + " | all identical |"
    rows = [head, "|" + " --- |" * (5 + len(names))]
    order = {"mt_bench": 0, "humaneval": 1, "gsm8k": 2}
    for r in sorted(runs, key=lambda r: (order.get(r["suite"], 9), r["temperature"], r["batch_size"])):
        m = r["methods"]
        same = all(m[n]["identical_to_ar"] for n in names) if r["temperature"] == 0 else "n/a"
        cells = " | ".join(f"{m[n]['tau']:.2f} / {m[n]['speedup_vs_ar']:.2f}x" for n in names)
        rows.append(f"| {r['suite']} | {r['temperature']:g} | {r['batch_size']} | {m['ar']['tokens_per_s']:.1f} | "
                    f"{cells} | {same} |")
    return "\n".join(rows)


def acceptance_table(r: dict) -> str:
    rows = [f"{r['suite']}, {r['prompts']} prompts, {r['max_new_tokens']} new tokens, T=0, tree {r['tree']}", "",
            "| method | tau | drafter fwd / token | accepted-length histogram | identical to ar |",
            "| --- | --- | --- | --- | --- |"]
    for name, m in r["methods"].items():
        rows.append(f"| {name} | {m['tau']:.2f} | {m['drafter_forwards_per_token']:.2f} | "
                    f"{' / '.join(map(str, m['accepted_hist']))} | {m['identical_to_ar']} |")
    return "\n".join(rows)


def hybrid_table(results: dict[str, dict]) -> str:
    """Per suite: tau and speedup of every method, and the hybrid's tau over its base method's."""
    runs = list(results.values())
    names = [n for n in runs[0]["methods"] if n != "ar"]
    hybrids = [n for n in names if "+lookup" in n and n.split("+")[0] in names]
    head = ("| suite | prompts | ar tok/s | " + " | ".join(f"{n}: tau / speedup" for n in names)
            + "".join(f" | {h} tau / {h.split('+')[0]} tau" for h in hybrids) + " | all identical |")
    rows = [head, "|" + " --- |" * (4 + len(names) + len(hybrids))]
    for r in runs:
        m = r["methods"]
        cells = " | ".join(f"{m[n]['tau']:.2f} / {m[n]['speedup_vs_ar']:.2f}x" for n in names)
        ratios = "".join(f" | {m[h]['tau'] / m[h.split('+')[0]]['tau']:.2f}x" for h in hybrids)
        same = all(m[n]["identical_to_ar"] for n in names)
        rows.append(f"| {r['suite']} | {r['num_prompts']} | {m['ar']['tokens_per_s']:.1f} | {cells}{ratios} | {same} |")
    return "\n".join(rows)


def hybrid_plot(results: dict[str, dict], path: str) -> None:
    """Grouped bars per suite: tau and speedup vs ar of every method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = list(results.values())
    names = [n for n in runs[0]["methods"] if n != "ar"]
    suites = [r["suite"].replace("spec_bench:", "") for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(names)
    for ax, key, label in ((axes[0], "tau", "tau (tokens per verify round)"),
                           (axes[1], "speedup_vs_ar", "speedup vs ar (tokens/s)")):
        for i, n in enumerate(names):
            ax.bar(np.arange(len(runs)) + i * width, [r["methods"][n][key] for r in runs], width, label=n)
        ax.set_xticks(np.arange(len(runs)) + width * (len(names) - 1) / 2, suites, rotation=30, ha="right")
        ax.set_ylabel(label)
        if key == "speedup_vs_ar":
            ax.axhline(1.0, color="k", lw=0.8)
    axes[0].legend()
    m = runs[0]["machine"]
    fig.suptitle(f"prompt lookup in the draft tree, T=0, batch 1 ({m['backend']}, {m.get('cpu_count')} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if sys.argv[1:2] == ["--hybrid"]:
        folder = sys.argv[2]
        results = _load(folder)
        text = hybrid_table(results) + "\n"
        with open(os.path.join(folder, "report.md"), "w") as f:
            f.write(text)
        print(text)
        try:
            hybrid_plot(results, os.path.join(folder, "hybrid.png"))
        except ImportError:
            print("matplotlib is not installed: no figure (pip install -e '.[plot]')")
        return
    folder = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
    results = _load(folder)
    parts = []
    for key, r in results.items():
        if "headline" in key:
            parts += ["### Headline", bench_table(r)]
    matrix = matrix_table(results)
    if matrix:
        parts += ["### Suites x temperature x batch (tau / median speedup vs ar)", matrix]
    for key, r in results.items():
        if key.startswith("acceptance"):
            parts += ["### Acceptance (batched, tau only)", acceptance_table(r)]
    text = "\n\n".join(parts) + "\n"
    with open(os.path.join(folder, "report.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
