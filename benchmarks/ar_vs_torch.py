"""JAX AR decode vs transformers' PyTorch `generate` on SmolLM2-135M, same prompts, greedy, batch 1.

Runs alternate (JAX, torch, JAX, torch, ...) in one process so machine drift cancels; compile
and warm-up are excluded. Prints tokens/s of each and the median per-prompt ratio.

    python benchmarks/ar_vs_torch.py --num-prompts 5 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from hsd_jax import generate, load_target
    from hsd_jax.loading.gguf_loader import default_gguf_path
    from hsd_jax.prompts import load_suite

    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", max_cache_len=1024)
    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    prompts = [target.encode(p, chat=True) for p in load_suite("mt_bench", args.num_prompts)]
    n = args.max_new_tokens

    def run_jax(ids):
        r = generate(target, [ids], max_new_tokens=n)[0]
        return len(r.token_ids), r.stats["seconds"], r.token_ids

    def run_torch(ids):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                              eos_token_id=target.config.eos_token_ids[0])
        return out.shape[1] - len(ids), time.perf_counter() - t0, out[0, len(ids):].tolist()

    run_jax(prompts[0]), run_torch(prompts[0])  # compile + warm-up
    rows = []
    for i, ids in enumerate(prompts):
        nj, tj, toks_j = run_jax(ids)
        nt, tt, toks_t = run_torch(ids)
        rows.append((nj / tj, nt / tt, toks_j == toks_t))
        print(f"prompt {i}: jax {nj / tj:6.1f} tok/s ({nj} tok)  torch {nt / tt:6.1f} tok/s ({nt} tok)  "
              f"identical={toks_j == toks_t}")
    jax_tps = statistics.median(r[0] for r in rows)
    torch_tps = statistics.median(r[1] for r in rows)
    ratio = statistics.median(r[0] / r[1] for r in rows)
    print(f"\nmedian: jax {jax_tps:.1f} tok/s, torch {torch_tps:.1f} tok/s, ratio {ratio:.2f}x "
          f"(threads={args.threads}, {n} new tokens, batch 1, f32)")


if __name__ == "__main__":
    main()
