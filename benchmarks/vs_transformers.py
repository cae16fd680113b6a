"""Anchors against transformers (PyTorch) on SmolLM2-135M, same GGUF, same chat prompts, greedy, batch 1.

`ar`: our jitted decode vs transformers' `generate`, runs alternating (JAX, torch, JAX, ...) in one
process so machine drift cancels, compile and warm-up excluded; tokens/s of each, the median
per-prompt ratio, and whether the outputs are identical.

`lookup`: our prompt lookup (`lookup`, chain of K, n-grams n..1) vs transformers' prompt-lookup
`generate` (`prompt_lookup_num_tokens=K`, `max_matching_ngram_size=n`): new tokens per target
forward for both (prefill included: HF's first forward already verifies a draft, ours emits one
token) and whether the outputs are identical.

    python benchmarks/vs_transformers.py ar --num-prompts 5 --max-new-tokens 128
    python benchmarks/vs_transformers.py lookup --num-prompts 16 --max-new-tokens 128 --k 6 --ngram 3 --json OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", choices=("ar", "lookup"))
    ap.add_argument("--suites", default=None, help="comma-separated suites (default: mt_bench for ar; "
                    "spec_bench:summarization,spec_bench:rag,mt_bench for lookup)")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--k", type=int, default=6, help="lookup: draft tokens per round (our gamma)")
    ap.add_argument("--ngram", type=int, default=3, help="lookup: longest n-gram matched (both try n..1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.suites = (args.suites or ("mt_bench" if args.method == "ar" else
                                   "spec_bench:summarization,spec_bench:rag,mt_bench")).split(",")
    return args


def ar_row(target, hf, torch, prompts, n):
    from hsd_jax import generate

    eos = target.config.eos_token_ids[0]

    def run_jax(ids):
        r = generate(target, [ids], max_new_tokens=n)[0]
        return len(r.token_ids), r.stats["seconds"], r.token_ids

    def run_torch(ids):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos)
        return out.shape[1] - len(ids), time.perf_counter() - t0, out[0, len(ids):].tolist()

    run_jax(prompts[0]), run_torch(prompts[0])  # compile + warm-up
    rows = []
    for i, ids in enumerate(prompts):
        nj, tj, toks_j = run_jax(ids)
        nt, tt, toks_t = run_torch(ids)
        rows.append((nj / tj, nt / tt, toks_j == toks_t))
        print(f"prompt {i}: jax {nj / tj:6.1f} tok/s ({nj} tok)  torch {nt / tt:6.1f} tok/s ({nt} tok)  "
              f"identical={toks_j == toks_t}", flush=True)
    return {"prompts": len(prompts), "jax_tokens_per_s": round(statistics.median(r[0] for r in rows), 1),
            "torch_tokens_per_s": round(statistics.median(r[1] for r in rows), 1),
            "ratio": round(statistics.median(r[0] / r[1] for r in rows), 2),
            "identical_outputs": sum(r[2] for r in rows)}


def lookup_row(target, hf, torch, prompts, n, k, ngram):
    from hsd_jax import generate, load_drafter

    calls = {"n": 0}
    hook = hf.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    drafter = load_drafter("lookup", target=target, max_ngram=ngram, min_ngram=1)
    ours_new = ours_fwd = hf_new = hf_fwd = same = 0
    for p in prompts:
        r = generate(target, [p], max_new_tokens=n, method="lookup", drafter=drafter, gamma=k)[0]
        ours_new += len(r.token_ids)
        ours_fwd += r.stats["target_forwards"]
        calls["n"] = 0
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=k,
                            max_matching_ngram_size=ngram, eos_token_id=target.config.eos_token_ids[0])
        hf_tokens = g[0, len(p):].tolist()
        hf_new += len(hf_tokens)
        hf_fwd += calls["n"]
        same += hf_tokens == r.token_ids
    hook.remove()
    return {"prompts": len(prompts), "ours_tokens_per_forward": round(ours_new / ours_fwd, 3),
            "hf_tokens_per_forward": round(hf_new / hf_fwd, 3), "identical_outputs": same}


def main() -> None:
    args = parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from hsd_jax import load_target
    from hsd_jax.loading.gguf_loader import default_gguf_path
    from hsd_jax.prompts import load_suite

    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", max_cache_len=1024 if args.method == "ar" else 2048)
    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    out = {"method": args.method, "max_new_tokens": args.max_new_tokens, "threads": args.threads, "suites": {}}
    if args.method == "lookup":
        out.update(k=args.k, ngram=args.ngram)
    for suite in args.suites:
        prompts = [target.encode(p, chat=True) for p in load_suite(suite, args.num_prompts)]
        row = (ar_row(target, hf, torch, prompts, args.max_new_tokens) if args.method == "ar" else
               lookup_row(target, hf, torch, prompts, args.max_new_tokens, args.k, args.ngram))
        out["suites"][suite] = row
        print(suite, row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
