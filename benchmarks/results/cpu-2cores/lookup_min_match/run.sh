#!/usr/bin/env bash
# lookup_min_match A/B (BENCHMARKS.md, "Lookup nodes only where the match is long"): 8 prompts x 96 tokens per suite.
cd "$(dirname "$0")/../../../.."
for suite in spec_bench:summarization spec_bench:translation spec_bench:rag mt_bench; do
  hsd bench --suite "$suite" --num-prompts 8 --max-new-tokens 96 --max-cache-len 2048 \
      --methods ar,lookup,hsd,hsd+lookup4/0,hsd+lookup4,hsd+lookup6 --gamma 6 --tree-nodes 3 --tree-depth 3 --top-k 1 \
      --json "benchmarks/results/cpu-2cores/lookup_min_match/${suite/:/_}.json" > "benchmarks/results/cpu-2cores/lookup_min_match/${suite/:/_}.log" 2>&1
done
