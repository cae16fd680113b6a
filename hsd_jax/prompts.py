"""Benchmark prompt suites shipped in `hsd_jax/data` (see its PROVENANCE.md) or given as a JSONL path."""
from __future__ import annotations

import json
import os

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
SUITES = {
    "mt_bench": "eagle_mt_bench.jsonl",
    "humaneval": "eagle_humaneval.jsonl",
    "gsm8k": "eagle_gsm8k.jsonl",
    "alpaca": "eagle_alpaca.jsonl",
    "sum": "eagle_sum.jsonl",
    "qa": "eagle_qa.jsonl",
    "spec_bench": "spec_bench_question.jsonl",
}


class SuiteError(ValueError):
    """A prompt suite is unknown or has a malformed line."""


def load_suite(name_or_path: str, num_prompts: int | None = None) -> list[str]:
    """First-turn prompts of a named suite or a JSONL file ({"turns": [...]} or {"prompt": ...} lines).

    `NAME:CATEGORY` keeps the records of one category (Spec-Bench: translation, summarization, qa,
    math_reasoning, rag, and MT-bench's writing, roleplay, ...)."""
    category = None
    if name_or_path not in SUITES and ":" in name_or_path and name_or_path.split(":", 1)[0] in SUITES:
        name_or_path, category = name_or_path.split(":", 1)
    path = os.path.join(DATA_DIR, SUITES[name_or_path]) if name_or_path in SUITES else name_or_path
    if not os.path.isfile(path):
        raise SuiteError(f"unknown suite {name_or_path!r}: use one of {', '.join(SUITES)} or a .jsonl path")
    prompts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SuiteError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            text = None
            if isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"]:
                text = rec["turns"][0]
            elif isinstance(rec, dict) and "prompt" in rec:
                text = rec["prompt"]
            if not isinstance(text, str) or not text.strip():
                raise SuiteError(f"{path}:{lineno}: expected a non-empty 'turns' list or 'prompt' string")
            if category is None or rec.get("category") == category:
                prompts.append(text)
    if not prompts:
        raise SuiteError(f"{path}: no prompts" + (f" in category {category!r}" if category else ""))
    return prompts[:num_prompts] if num_prompts else prompts
