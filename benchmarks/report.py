"""Markdown tables for BENCHMARKS.md from a folder of `hsd bench` / acceptance JSON results.

    python benchmarks/report.py benchmarks/results/cpu-2cores > report.md
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


def main() -> None:
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
