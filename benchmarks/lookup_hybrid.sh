#!/usr/bin/env bash
# Prompt lookup, HSD and HSD with lookup nodes in its tree, side by side per Spec-Bench category
# and HumanEval (one `hsd bench` process per suite, methods interleaved per prompt, T=0, batch 1).
# Results: benchmarks/results/<hardware>/lookup_hybrid/*.json, then the table and figure
# (benchmarks/report.py --hybrid). Sizes: N prompts per suite, TOKENS new tokens; TREE: extra
# `hsd bench` flags for the tree, e.g. TREE="--tree-nodes 3 --tree-depth 2 --top-k 2"; SUITES: a subset
# of the suites below; REPEATS: runs per prompt and method, the fastest counted (environment).
set -euo pipefail
cd "$(dirname "$0")/.."
HW=$(python -c "from hsd_jax.tuning import hardware_key; print(hardware_key())")
OUT=${OUT:-benchmarks/results/$HW/lookup_hybrid}
mkdir -p "$OUT"
N=${N:-8}
TOKENS=${TOKENS:-96}
METHODS=${METHODS:-ar,lookup,hsd,hsd+lookup}
SUITES=${SUITES:-spec_bench:summarization spec_bench:rag spec_bench:qa spec_bench:translation spec_bench:math_reasoning mt_bench humaneval}
for suite in $SUITES; do
  hsd bench --suite "$suite" --num-prompts "$N" --max-new-tokens "$TOKENS" --max-cache-len 2048 \
      --methods "$METHODS" --gamma 6 --repeats "${REPEATS:-1}" ${TREE:-} --json "$OUT/${suite/:/_}.json"
done
python benchmarks/report.py --hybrid "$OUT"
