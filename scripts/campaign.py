"""The drafter campaign (issue 37): HSD and EAGLE-style trained at equal budget, in alternating chunks,
resumable on this machine and on a new one.

    nice -n 5 python scripts/campaign.py [--runs DIR] [--chunk 500] [--kinds hsd,eagle]

Each kind runs `configs/train/campaign_<kind>.yaml` with its out_dir and feature cache under --runs
(default $HSD_CAMPAIGN_DIR or ~/hsd-campaign: outside the work tree), `--chunk` steps at a time
(`train(..., until_step=)`: the schedule still spans the config's steps), one kind after the other,
until both reach it. After every chunk the kind's exported drafter (bf16 params) and its step go to
`train_data/campaign/<kind>/` (drafter/, state.json with the held-out curve so far): commit that
before a session stops. A run resumes from whichever is newer: its Orbax checkpoint here, or the
committed state (its params, fresh optimizer moments, the schedule at its step). Data positions need
no state: step s draws its batch from a generator seeded by s. Missing feature caches are rebuilt
(the first chunk of a new machine prefills every shard); missing text data is regenerated.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = os.path.join(ROOT, "train_data", "campaign")
TEXT_DATA = {   # data directory -> the command that writes it (deterministic)
    "train_data/smollm2-135m-gsm8k-ref": ["--gsm8k", "../shared/data/gsm8k_train.jsonl"],
    "train_data/smollm2-135m-pystdlib": ["--python-stdlib", "--max-rows", "10000"],
}


def latest_checkpoint(run_dir: str) -> int:
    steps = [int(os.path.basename(p)) for p in glob.glob(os.path.join(run_dir, "checkpoints", "*"))
             if os.path.basename(p).isdigit()]
    return max(steps, default=0)


def committed_step(kind: str) -> int:
    path = os.path.join(STATE, kind, "state.json")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return int(json.load(f)["step"])


def commit_state(kind: str, run_dir: str, step: int) -> None:
    """Copy the exported drafter and the curve so far into the work tree (atomically per kind)."""
    dst = os.path.join(STATE, kind)
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(os.path.join(run_dir, "drafter"), os.path.join(tmp, "drafter"))
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        curve = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"kind": kind, "step": step, "config": f"configs/train/campaign_{kind}.yaml",
                   "history": curve}, f, indent=1)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def seed_history(kind: str, run_dir: str) -> None:
    """Start a new run directory's history.jsonl with the committed curve, so the curve a chunk commits
    still spans every step (a new machine has no run directory of its own)."""
    path = os.path.join(STATE, kind, "state.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        curve = json.load(f)["history"]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "history.jsonl"), "w") as f:
        f.writelines(json.dumps(point) + "\n" for point in curve)


def run_from_state(kind: str, config: str, out: str) -> str:
    """A run directory for `ship` made from the committed state alone (a machine without the run): its
    drafter, the config it trained with, the held-out curve and the data's token counts."""
    from hsd_jax.train.data import load_shards
    from hsd_jax.train.trainer import TrainConfig

    with open(os.path.join(STATE, kind, "state.json")) as f:
        state = json.load(f)
    cfg = TrainConfig.from_yaml(config, out_dir=out)
    seqs, plens = load_shards(cfg.data_dirs)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(os.path.join(STATE, kind, "drafter"), os.path.join(out, "drafter"))
    with open(os.path.join(out, "train_config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump({"final": state["history"][-1], "history": state["history"][:-1],
                   "train_tokens": int(sum(len(s) for s in seqs)),
                   "response_tokens": int(sum(len(s) - p for s, p in zip(seqs, plens)))}, f, indent=1)
    return out


def ship_finished(runs: str, kinds: list[str], notes: str) -> None:
    """Ship every kind whose run reached its config's steps (`hsd_jax.train.ship`: drafter and card)."""
    from hsd_jax.train.ship import ship
    from hsd_jax.train.trainer import TrainConfig

    for kind in kinds:
        config = f"configs/train/campaign_{kind}.yaml"
        steps = TrainConfig.from_yaml(config).steps
        run_dir = os.path.join(runs, kind)
        if latest_checkpoint(run_dir) < steps <= committed_step(kind):   # a new machine: the committed state
            run_dir = run_from_state(kind, config, os.path.join(runs, f"{kind}-committed"))
        elif latest_checkpoint(run_dir) < steps:
            raise SystemExit(f"{kind}: the run in {run_dir} is at step {latest_checkpoint(run_dir)} of {steps}; "
                             "finish it first")
        text = (f"Trained by `scripts/campaign.py` (issue 37): hsd, eagle and eagle3 at equal budget (same data, "
                f"steps, unroll, draft vocabulary, each warm-started from its previously shipped drafter), in chunks of "
                f"250 steps, resumed across sessions from `train_data/campaign/{kind}/`. " + notes).strip()
        print(ship(run_dir, "smollm2-135m", kind, config_path=config,
                   command="python scripts/campaign.py --chunk 250", notes=text))


def ensure_text_data() -> None:
    for data_dir, args in TEXT_DATA.items():
        if not glob.glob(os.path.join(ROOT, data_dir, "shard_*.npz")):
            subprocess.run([sys.executable, "-m", "hsd_jax", "data", "text", "--out", data_dir, *args],
                           cwd=ROOT, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=os.environ.get("HSD_CAMPAIGN_DIR", os.path.expanduser("~/hsd-campaign")))
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--kinds", default="hsd,eagle")
    ap.add_argument("--until", type=int, default=0, help="stop once every kind reaches this step (0: the config's steps)")
    ap.add_argument("--ship", action="store_true",
                    help="install each finished kind's drafter as the shipped one (hsd_jax/drafters/), with its card")
    ap.add_argument("--notes", default="", help="with --ship: text for the cards' Notes (e.g. the MT-bench comparison)")
    a = ap.parse_args()
    os.chdir(ROOT)
    if a.ship:
        ship_finished(a.runs, a.kinds.split(","), a.notes)
        return
    ensure_text_data()
    from hsd_jax.api import load_target
    from hsd_jax.train.features import build_feature_cache, cache_complete
    from hsd_jax.train.trainer import TrainConfig, train

    target = load_target("smollm2-135m", max_cache_len=512, tokenizer=False)
    kinds = a.kinds.split(",")
    while True:
        pending = 0
        for kind in kinds:
            cfg = TrainConfig.from_yaml(f"configs/train/campaign_{kind}.yaml",
                                        out_dir=os.path.join(a.runs, kind),
                                        feature_cache=os.path.join(a.runs, "features"))
            here, there = latest_checkpoint(cfg.out_dir), committed_step(kind)
            if there > here:   # a new machine (or an older local run): continue from the committed state
                shutil.rmtree(cfg.out_dir, ignore_errors=True)
                seed_history(kind, cfg.out_dir)
                cfg = dataclasses.replace(cfg, init_from=os.path.join(STATE, kind, "drafter"), start_step=there)
            # the self-distilled sets (and the held-out rows) first; text sets join once their features are cached
            ready = [d for d in cfg.data_dirs
                     if d not in TEXT_DATA or cache_complete(d, cfg.feature_cache, cfg.feature_layers)]
            weights = tuple(w for d, w in zip(cfg.data_dirs, cfg.data_weights) if d in ready)
            cfg = dataclasses.replace(cfg, data_dir=tuple(ready), data_weights=weights)
            step = max(here, there)
            end = min(cfg.steps, a.until or cfg.steps)
            if step >= end:
                continue
            pending += 1
            until = min(end, (step // a.chunk + 1) * a.chunk)
            t0 = time.time()
            final = train(cfg, target=target, until_step=until)
            commit_state(kind, cfg.out_dir, until)
            print(f"[campaign] {kind} {step} -> {until} in {(time.time() - t0) / 60:.1f} min: "
                  f"{json.dumps({k: final[k] for k in ('accept_by_depth', 'window_tokens_per_s')})}", flush=True)
        if not pending:
            print("[campaign] done", flush=True)
            return
        missing = [d for d in TEXT_DATA if not cache_complete(d, cfg.feature_cache, cfg.feature_layers)]
        if missing:   # one more text set's features before the next round
            build_feature_cache(target, missing[0], cfg.feature_cache, batch_size=cfg.feature_batch,
                                feature_layers=cfg.feature_layers, matmul_dtype=cfg.compute_dtype)


if __name__ == "__main__":
    main()
