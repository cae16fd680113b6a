"""How many prompt-lookup tokens the target accepts, by the length of the lookup match.

For every position of the target's greedy output (T = 0, chat prompts), the lookup continuation
(`methods.lookup.lookup_chain`'s rule in plain Python: the latest earlier occurrence of the last
n tokens, n = 3, 2, 1) is compared with what the target actually wrote next: the accepted length
at T = 0. Grouped by the match's n (0: no match), per suite. The evidence behind
`SpecConfig.lookup_min_match`.

    python benchmarks/lookup_match.py --num-prompts 8 --max-new-tokens 96 --json OUT
"""
from __future__ import annotations

import argparse
import json

import hsd_jax
from hsd_jax.prompts import load_suite

SUITES = ("spec_bench:summarization", "spec_bench:rag", "spec_bench:translation", "mt_bench", "spec_bench:qa",
          "humaneval")


def match_and_accepted(seq: list[int], root: int, k: int, max_ngram: int = 3) -> tuple[int, int]:
    """(n, accepted): the match's length for the committed seq[:root + 1] and how many of the k
    proposed tokens equal seq[root + 1:]."""
    for n in range(max_ngram, 0, -1):
        if root + 1 <= n:
            continue
        suffix = seq[root - n + 1: root + 1]
        for end in range(root - 1, n - 2, -1):
            if seq[end - n + 1: end + 1] == suffix:
                acc = 0
                while (acc < k and end + 1 + acc <= root and root + 1 + acc < len(seq)
                       and seq[end + 1 + acc] == seq[root + 1 + acc]):
                    acc += 1
                return n, acc
    return 0, 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=6, help="lookup continuation length")
    p.add_argument("--suites", default=",".join(SUITES))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    target = hsd_jax.load_target()
    out = {}
    for suite in a.suites.split(","):
        prompts = load_suite(suite, a.num_prompts)
        by_n = {n: [] for n in range(4)}
        for prompt in prompts:
            ids = target.encode(prompt, chat=True)
            new = hsd_jax.generate(target, [prompt], max_new_tokens=a.max_new_tokens, chat=True)[0].token_ids
            seq = list(ids) + list(new)
            for root in range(len(ids), len(seq) - 1):
                n, acc = match_and_accepted(seq, root, a.k)
                by_n[n].append(acc)
        out[suite] = {n: {"positions": len(v), "mean_accepted": round(sum(v) / max(len(v), 1), 3),
                          "at_least_one": round(sum(x > 0 for x in v) / max(len(v), 1), 3)} for n, v in by_n.items()}
        print(suite, json.dumps(out[suite]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"k": a.k, "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens, "suites": out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
