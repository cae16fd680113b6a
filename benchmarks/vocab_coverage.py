"""Draft-vocabulary coverage: the share of response tokens a draft vocabulary of size V contains,
built from the training rows of some data directories and measured on their held-out rows and on
a data set that did not build it. Tokens outside the vocabulary can never be drafted.

    python benchmarks/vocab_coverage.py --build train_data/smollm2-135m-v1 \
        --other train_data/smollm2-135m-sharegpt2 --sizes 4096,8192,16384 --json OUT
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", nargs="+", required=True, help="data directories the vocabulary is built from")
    ap.add_argument("--other", nargs="*", default=[], help="data directories it is also measured on")
    ap.add_argument("--sizes", default="4096,8192,16384")
    ap.add_argument("--vocab-size", type=int, default=49152, help="the target's vocabulary")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from hsd_jax.train.data import load_shards
    from hsd_jax.train.trainer import SequenceData, draft_vocab

    data = SequenceData(args.build, None, 256, 0.05, 0)
    train = [data.rows[r] for r in data.train]
    held = np.concatenate([data.rows[r][0][data.rows[r][3]:] for r in data.holdout])
    other = None
    if args.other:
        seqs, plens = load_shards(args.other)
        other = np.concatenate([s[p:] for s, p in zip(seqs, plens)])
    out = {"build": args.build, "other": args.other, "train_rows": len(train), "heldout_tokens": int(len(held)),
           "other_tokens": int(len(other)) if other is not None else 0,
           "distinct_train_tokens": int(len(np.unique(np.concatenate([r[0][r[3]:] for r in train])))), "sizes": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        inside = np.zeros(args.vocab_size, bool)
        inside[draft_vocab([r[0] for r in train], [r[3] for r in train], args.vocab_size, size)] = True
        row = {"heldout": round(float(inside[held].mean()), 4)}
        if other is not None:
            row["other"] = round(float(inside[other].mean()), 4)
        out["sizes"][size] = row
        print(size, row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
