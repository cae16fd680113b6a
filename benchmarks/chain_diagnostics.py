"""Chain diagnostics of trained feature drafters on held-out training sequences (HSD.md, "A chain
that works"): per depth, top-1 acceptance along the target's greedy path, acceptance with the chain
bypassed (the read-out on the last true feature), and the chain state's feature error over the
copy baseline's. The same numbers `hsd train` reports at the end of a run, for any drafter.

    python benchmarks/chain_diagnostics.py --drafter hsd=shipped --drafter eagle=shipped \
        --data train_data/smollm2-135m-v1 --data train_data/smollm2-135m-sharegpt2 --depth 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def diagnose(target, drafter, data, batch_size: int, depth: int) -> dict:
    import jax
    import jax.numpy as jnp

    from hsd_jax.models import drafter as dmod
    from hsd_jax.train import losses
    from hsd_jax.train.trainer import _float32, heldout_report

    params = _float32(drafter.params)
    cfg = drafter.config
    view = dmod.target_view(target.params, target.config, drafter.d2t)
    t2d = dmod.target_to_draft(drafter.d2t, target.config.vocab_size)
    fn = jax.jit(lambda p, b: losses.chain_acceptance(p, cfg, view, jnp.asarray(t2d), b, depth))
    return heldout_report(lambda b: fn(params, b), data, batch_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", action="append", required=True, metavar="KIND=PATH",
                    help="hsd or eagle drafter directory, or KIND=shipped (repeatable)")
    ap.add_argument("--data", action="append", required=True, metavar="DIR", help="training data directory")
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--holdout-fraction", type=float, default=0.05, help="as the runs were trained with")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import numpy as np

    from hsd_jax import load_drafter, load_target
    from hsd_jax.train.features import _features
    from hsd_jax.train.trainer import SequenceData

    target = load_target(max_cache_len=512, tokenizer=False)
    data = SequenceData(a.data, None, a.window, a.holdout_fraction, seed=0)
    cfg = target.config.replace(feature_layers=())
    for r in data.holdout:  # target features of the held-out rows only (full-sequence prefill)
        tokens, _, _, plen, _ = data.rows[r]
        padded = np.zeros((1, -(-len(tokens) // 64) * 64), np.int32)
        padded[0, : len(tokens)] = tokens
        feats = np.asarray(_features(target.params, cfg, padded)[0], np.float32)[:, : len(tokens)]
        data.rows[r] = (tokens, feats, 0, plen, None)
    out = {"data": a.data, "heldout_sequences": len(data.holdout), "window": a.window, "depth": a.depth,
           "drafters": {}}
    for item in a.drafter:
        kind, _, path = item.partition("=")
        drafter = load_drafter(kind, None if path == "shipped" else path, target=target)
        out["drafters"][item] = diagnose(target, drafter, data, a.batch_size, a.depth)
        print(item, json.dumps(out["drafters"][item]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
