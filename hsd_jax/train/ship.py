"""Copy a finished training run's drafter into the package with a model card."""
from __future__ import annotations

import json
import os
import shutil

from hsd_jax.api import ORBAX_COMMIT_MARKER, SHIPPED_DRAFTERS


def _size_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def _thinned(history: list, rows: int = 20) -> list:
    """A long learning curve's points at round steps (about `rows` of them), for a card a reader can scan."""
    if len(history) <= rows:
        return history
    last = history[-1]["step"]
    every = max(1, last // rows)
    every = next(m for m in (250, 500, 1000, 2000, 5000, 10000, last) if m >= every)
    return [h for h in history if h["step"] % every == 0]


def _portable(path: str) -> str:
    """A run's data or drafter directory as the card names it: relative to the working directory when
    under it (`train_data/...`), else its last component, never this machine's absolute path."""
    rel = os.path.relpath(os.path.abspath(path))
    return rel if not rel.startswith(os.pardir) else os.path.basename(os.path.normpath(path))


def ship(run_dir: str, model: str, kind: str, *, config_path: str, command: str, notes: str = "") -> str:
    """Install `run_dir/drafter` as the default `kind` drafter of `model`; writes MODEL_CARD.md."""
    src = os.path.join(run_dir, "drafter")
    metrics = json.load(open(os.path.join(run_dir, "metrics.json")))
    cfg = json.load(open(os.path.join(run_dir, "train_config.json")))
    dst = os.path.join(SHIPPED_DRAFTERS, model, kind)
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(ORBAX_COMMIT_MARKER))  # it names the run's absolute path
    final, hist = metrics["final"], metrics["history"]
    lines = [
        f"# {kind} drafter for {model}",
        "",
        f"Trained with `{command}` (config `{config_path}`). The run's Orbax checkpoints (params and",
        "optimizer state, every `save_every` steps) stay in its `runs/` directory, outside git: rerunning the",
        "command resumes from the last one on the same machine.",
        "",
        "## Data",
        f"- Data sets: {', '.join(f'`{_portable(d)}`' for d in ([cfg['data_dir']] if isinstance(cfg['data_dir'], str) else cfg['data_dir']))}",
        f"- Self-distilled: {model} answered GSM8K-train questions and ShareGPT first user turns with its",
        "  chat template (greedy, <= 128 new tokens). No evaluation prompts (MT-bench, HumanEval, ...).",
        "  Sources, licenses and the command that wrote each set: `train_data/README.md`.",
        f"- {metrics['train_tokens']} tokens in all, {metrics['response_tokens']} of them response tokens;",
        f"  {cfg['holdout_fraction']:.0%} of the sequences held out for evaluation.",
        "",
        "## Training",
        f"- steps {final['step']}, batch {cfg['batch_size']} sequences, window {cfg['window']} tokens, "
        f"unroll {cfg['unroll']}, lr {cfg['learning_rate']} (warmup {cfg['warmup_steps']}, cosine), AdamW, clip {cfg['grad_clip']}",
        *([f"- started from the drafter in `{_portable(cfg['init_from'])}` (its own card: the previous version of this file)"]
          if cfg.get("init_from") else []),
        *([f"- wall time of the last (resumed) run: {final['wall_seconds_this_run'] / 60:.1f} min on a 2-core CPU",
           f"- loss: first 10 steps {final['loss_first']}, last 10 steps {final['loss_last']}"]
          if final.get("wall_seconds_this_run") is not None else
          ["- shipped from the committed state (drafter and held-out curve): its runs' wall times and losses stayed",
           "  on the machines that ran them"]),
        "",
        "## Held-out metrics (top-1 chain along the target's greedy path)",
    ]
    columns = [("acceptance by depth", "accept_by_depth"), ("chain tau estimate", "chain_tau_estimate")]
    if any("bypass_accept_by_depth" in h for h in hist + [final]):   # hsd and eagle: a chain to bypass
        lines += ["Per depth: acceptance; acceptance with the chain bypassed (the read-out on the last true",
                  "feature: a working chain loses many points); the chain state's distance to the true next",
                  "feature over the copy baseline's (below 1: the chain beats copying the last feature)."]
        columns[1:1] = [("bypassed", "bypass_accept_by_depth"), ("feature error vs copy", "feature_error_vs_copy")]
    lines += ["", "| step | " + " | ".join(c for c, _ in columns) + " |", "|" + " --- |" * (len(columns) + 1)]
    lines += [f"| {h['step']} | " + " | ".join(str(h.get(k, "-")) for _, k in columns) + " |" for h in _thinned(hist) + [final]]
    lines += ["", f"Checkpoint size: {_size_mb(dst):.1f} MB (bf16 params).", ""]
    if notes:
        lines += ["## Notes", notes, ""]
    with open(os.path.join(dst, "MODEL_CARD.md"), "w") as f:
        f.write("\n".join(lines))
    return dst
