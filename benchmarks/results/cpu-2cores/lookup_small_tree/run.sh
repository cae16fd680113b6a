#!/usr/bin/env bash
# A small learned tree (1 node) beside 6 prompt-lookup nodes in every round (BENCHMARKS.md, "A one-node tree
# beside the lookup chain"): 8 prompts x 96 tokens per suite.
cd "$(dirname "$0")/../../../.."
for suite in spec_bench:summarization spec_bench:rag; do
  hsd bench --suite "$suite" --num-prompts 8 --max-new-tokens 96 --max-cache-len 2048 \
      --methods ar,lookup,hsd,hsd+lookup5/0,hsd+lookup6/0 --gamma 6 --tree-nodes 1 --tree-depth 1 --top-k 1 \
      --json "benchmarks/results/cpu-2cores/lookup_small_tree/${suite/:/_}.json"
done
