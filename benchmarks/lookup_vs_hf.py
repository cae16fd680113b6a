"""Anchor check for `lookup`: our prompt lookup against transformers' prompt-lookup `generate`
(`prompt_lookup_num_tokens=K`, `max_matching_ngram_size=n`) on SmolLM2-135M, same prompts, greedy.

Reports new tokens per target forward for both (prefill included: HF's first forward already
verifies a draft, ours emits one token) and whether the outputs are identical.

    python benchmarks/lookup_vs_hf.py --suites spec_bench:summarization,spec_bench:rag --num-prompts 8 \
        --max-new-tokens 64 --k 6 --ngram 3 --json OUT
"""
from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", default="spec_bench:summarization,spec_bench:rag,mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=6, help="draft tokens per round (our gamma)")
    ap.add_argument("--ngram", type=int, default=3, help="longest n-gram matched (both try n..1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from hsd_jax import generate, load_drafter, load_target
    from hsd_jax.loading.gguf_loader import default_gguf_path
    from hsd_jax.prompts import load_suite

    target = load_target("smollm2-135m", max_cache_len=2048)
    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    calls = {"n": 0}
    hf.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    drafter = load_drafter("lookup", target=target, max_ngram=args.ngram, min_ngram=1)
    eos = target.config.eos_token_ids[0]
    out = {"k": args.k, "ngram": args.ngram, "max_new_tokens": args.max_new_tokens, "suites": {}}
    for suite in args.suites.split(","):
        ids = [target.encode(p, chat=True) for p in load_suite(suite, args.num_prompts)]
        ours_new = ours_fwd = hf_new = hf_fwd = same = 0
        for p in ids:
            r = generate(target, [p], max_new_tokens=args.max_new_tokens, method="lookup", drafter=drafter,
                         gamma=args.k)[0]
            ours_new += len(r.token_ids)
            ours_fwd += r.stats["target_forwards"]
            calls["n"] = 0
            with torch.no_grad():
                g = hf.generate(torch.tensor([p]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                prompt_lookup_num_tokens=args.k, max_matching_ngram_size=args.ngram,
                                eos_token_id=eos)
            hf_tokens = g[0, len(p):].tolist()
            hf_new += len(hf_tokens)
            hf_fwd += calls["n"]
            same += hf_tokens == r.token_ids
        row = {"prompts": len(ids), "ours_tokens_per_forward": round(ours_new / ours_fwd, 3),
               "hf_tokens_per_forward": round(hf_new / hf_fwd, 3), "identical_outputs": same}
        out["suites"][suite] = row
        print(suite, row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
