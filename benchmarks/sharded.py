"""Tokens/s of `ar` and `hsd` generate on several (data x model) meshes.

On a CPU host the devices are fake (`--xla_force_host_platform_device_count`): they share the
same cores, so the numbers only measure the partitioning and collective overhead of a mesh,
not a speed-up. On a multi-chip host (GPUs, a TPU VM) the same command measures real scaling;
see scripts/sharded_multichip.sh for the prepared runs, multi-host included.

    python benchmarks/sharded.py --meshes 1x1,1x8,2x4,4x2,8x1 --batch 8 --max-new-tokens 32
    python benchmarks/sharded.py --model smollm2-135m --meshes 1x1,1x3,3x1 --batch 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (random 8-head target), smollm2-135m or a path")
    ap.add_argument("--meshes", default="1x1,1x8,2x4,4x2,8x1",
                    help="comma-separated DATAxMODEL meshes, or 'auto': 1x1 and every split of all devices "
                         "that the KV heads and the batch allow")
    ap.add_argument("--methods", default="ar,hsd")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fake-cpu-devices", type=int, default=8,
                    help="CPU devices to fake (ignored by GPU/TPU backends); 0 keeps XLA_FLAGS as is")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    return ap.parse_args(argv)


def build(model: str):
    """The target (a random tiny 8-head model, or a loaded one) and a random HSD drafter for it."""
    from hsd_jax import load_drafter, load_target
    from hsd_jax.api import Target
    from hsd_jax.config import ModelConfig
    from hsd_jax.models import llama

    if model == "tiny":
        import jax

        cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                          num_kv_heads=8, attention_impl="auto")
        target = Target(llama.init_params(cfg, jax.random.key(0), init_std=0.3), cfg, None, 512, "tiny")
    else:
        target = load_target(model, max_cache_len=512, tokenizer=False)
    return target, load_drafter("hsd", target=target, random_init=True)


def auto_meshes(n_devices: int, kv_heads: int, batch: int) -> list[tuple[int, int]]:
    """1x1 plus every data x model split of all devices with model | kv_heads and data | batch."""
    splits = [(n_devices // m, m) for m in range(1, n_devices + 1)
              if n_devices % m == 0 and kv_heads % m == 0 and batch % (n_devices // m) == 0]
    return [(1, 1)] + [s for s in splits if s != (1, 1)]


def measure(target, drafter, prompts, method: str, mesh, max_new_tokens: int, repeats: int) -> dict:
    from hsd_jax import generate

    kw = dict(max_new_tokens=max_new_tokens, mesh=mesh)
    if method == "hsd":
        kw.update(method="hsd", drafter=drafter, tree_nodes=6, tree_depth=3, tree_top_k=2, reuse="chain")
    first = generate(target, prompts, **kw)
    runs = [generate(target, prompts, **kw) for _ in range(repeats)]
    secs = statistics.median(r[0].stats["seconds"] for r in runs)
    tokens = sum(r.stats["new_tokens"] for r in runs[0])
    return {"compile_s": round(first[0].stats["compile_seconds"], 2), "seconds": round(secs, 4),
            "tokens_per_s": round(tokens / secs, 1), "tokens": tokens,
            "tau": round(statistics.mean(r.stats["tau"] for r in runs[0]), 3),
            "ids": [r.token_ids for r in first]}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.fake_cpu_devices:
        flag = f"--xla_force_host_platform_device_count={args.fake_cpu_devices}"
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), flag]))
    import jax
    import numpy as np

    from hsd_jax import distributed, sharding

    distributed.maybe_initialize_distributed()
    backend = jax.default_backend()
    note = ("fake CPU devices share the same cores: this measures mesh overhead only, not scaling"
            if backend == "cpu" else f"{jax.device_count()} {backend} devices")
    target, drafter = build(args.model)
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    prompts = [rng.integers(0, vocab, size=int(rng.integers(8, 24))).tolist() for _ in range(args.batch)]
    out = print if distributed.is_primary() else (lambda *_: None)
    out(f"# backend={backend} devices={jax.device_count()} model={args.model} batch={args.batch} "
        f"new_tokens={args.max_new_tokens}: {note}")
    rows, first_ids = [], {}
    meshes = (auto_meshes(jax.device_count(), target.config.num_kv_heads, args.batch) if args.meshes == "auto"
              else [sharding.parse_mesh(m) for m in args.meshes.split(",")])
    for data, model in meshes:
        mesh = None if data * model == 1 else sharding.make_mesh(data, model)
        for method in args.methods.split(","):
            row = dict(mesh=f"{data}x{model}", method=method, **measure(target, drafter, prompts, method, mesh,
                                                                        args.max_new_tokens, args.repeats))
            ids = row.pop("ids")
            row["same_tokens_as_first_mesh"] = ids == first_ids.setdefault(method, ids)
            rows.append(row)
            out(json.dumps(row) if args.json else
                f"{row['mesh']:>5} {method:>4}  {row['tokens_per_s']:>9.1f} tok/s  run {row['seconds']:.3f} s"
                f"  compile {row['compile_s']:.1f} s  tau {row['tau']}  same tokens {row['same_tokens_as_first_mesh']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
