"""Window tokens/s of one drafter training step, f32 against bf16 matmul inputs, interleaved in one
process (BENCHMARKS.md, "Training throughput"). The trainer's own step (`make_train_step`, AdamW) on
SmolLM2-135M's drafters at the campaign's shape (batch 8, window 160, unroll 4, 48 token-loss
positions per row, 8,192-token draft vocabulary); features are random (cost does not depend on them).

    python benchmarks/train_throughput.py --kinds hsd,eagle --repeats 8 [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.api import load_target
from hsd_jax.models import drafter as dmod
from hsd_jax.train import losses
from hsd_jax.train.trainer import TrainConfig, make_optimizer, make_train_step, with_matmul_inputs


def step_fns(kind: str, target, batch: int, window: int, unroll: int):
    d2t = np.arange(8192, dtype=np.int32) * 5
    dcfg = dmod.DrafterConfig.for_target(kind, target.config, draft_vocab_size=len(d2t), feature_rms=32.0)
    consts = {"view": dmod.target_view(target.params, target.config, d2t),
              "t2d": jnp.asarray(dmod.target_to_draft(d2t, target.config.vocab_size))}
    weights = losses.LossWeights(feature=1.0, ce=0.5)

    def loss(params, b, key, consts):
        return losses.drafter_loss(params, dcfg, consts["view"], consts["t2d"], b, key, steps=unroll,
                                   ce_positions=48, weights=weights)

    params = dmod.init_drafter_params(dcfg, jax.random.key(0))
    cfg = TrainConfig(kind=kind, data_dir="unused", out_dir="unused")
    tx = make_optimizer(cfg, params)
    state = {"params": params, "opt": tx.init(params)}
    rng = np.random.default_rng(0)
    b = losses.Batch(jnp.asarray(rng.integers(0, 40000, (batch, window)), jnp.int32),
                     jnp.asarray(rng.normal(size=(batch, window, target.config.hidden_size)) * 30, jnp.float16),
                     jnp.ones((batch, window), bool), jnp.ones((batch, window), bool))
    fns = {dt: make_train_step(with_matmul_inputs(loss, dt), tx) for dt in ("float32", "bfloat16")}
    return fns, state, b, consts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="hsd,eagle")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=160)
    ap.add_argument("--unroll", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    target = load_target("smollm2-135m", max_cache_len=512, tokenizer=False)
    out = {}
    for kind in a.kinds.split(","):
        fns, state, b, consts = step_fns(kind, target, a.batch, a.window, a.unroll)
        key, lr = jax.random.key(1), np.float32(1e-4)
        for f in fns.values():   # compile
            jax.block_until_ready(f(state, b, key, lr, consts))
        times = {dt: [] for dt in fns}
        for _ in range(a.repeats):
            for dt, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(state, b, key, lr, consts))
                times[dt].append(time.perf_counter() - t0)
        med = {dt: float(np.median(v)) for dt, v in times.items()}
        out[kind] = {dt: {"seconds_per_step": round(s, 4), "window_tokens_per_s": round(a.batch * a.window / s, 1)}
                     for dt, s in med.items()}
        out[kind]["speedup_bf16"] = round(med["float32"] / med["bfloat16"], 3)
        print(kind, json.dumps(out[kind]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(out, batch=a.batch, window=a.window, unroll=a.unroll, repeats=a.repeats), f, indent=1)


if __name__ == "__main__":
    main()
