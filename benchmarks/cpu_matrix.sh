#!/usr/bin/env bash
# The BENCHMARKS.md runs on a CPU machine that `hsd bench` and `acceptance.py` reproduce: the headline
# (MT-bench, 40 prompts, T=0, batch 1, the tuned 3/2/2 tree with 4 lookup nodes in every round, `/0`), the matrix of
# suites x temperature x batch on 16-prompt subsets (at the 2/2/1 tree it was measured at), and
# MT-bench acceptance on all 80 prompts at two trees (batched: tau does not depend on batching),
# then the report tables. Every run is one process (methods interleaved per batch). Rerun a single
# line to refresh one table. Results: benchmarks/results/<hardware>/*.json, figures next to them.
set -euo pipefail
cd "$(dirname "$0")/.."
HW=$(python -c "from hsd_jax.tuning import hardware_key; print(hardware_key())")
OUT=benchmarks/results/$HW
mkdir -p "$OUT"

hsd bench --suite mt_bench --num-prompts 40 --max-new-tokens 128 \
    --methods ar,hsd,hsd+lookup4/0,eagle+lookup4/0,eagle3+lookup4/0,lookup,ngram --tree-nodes 3 --tree-depth 2 --top-k 2 \
    --json "$OUT/mt_bench_T0_b1_headline.json" --plot "$OUT/mt_bench_T0_b1_headline.png"
for suite in mt_bench humaneval gsm8k; do
  for temp in 0 1; do
    for bs in 1 4; do
      name=${suite}_T${temp}_b${bs}
      [[ $name == mt_bench_T0_b1 ]] && continue
      hsd bench --suite $suite --num-prompts 16 --max-new-tokens 64 --temperature $temp --batch-size $bs \
          --methods ar,sd,eagle,hsd --tree-nodes 2 --tree-depth 2 --top-k 1 \
          --json "$OUT/$name.json" --plot "$OUT/$name.png"
    done
  done
done
python benchmarks/acceptance.py --suite mt_bench --num-prompts 80 --max-new-tokens 128 --tree-nodes 3 --tree-depth 2 \
    --top-k 2 --methods hsd-noreuse,hsd-refresh,eagle,eagle3,ngram --json "$OUT/acceptance_mt_bench_3-2-2.json"
# the same at a wider, deeper tree: where depth and branching matter
python benchmarks/acceptance.py --suite mt_bench --num-prompts 80 --max-new-tokens 128 --tree-nodes 8 --tree-depth 4 \
    --top-k 3 --methods hsd-noreuse,hsd-refresh,eagle,eagle3,ngram --json "$OUT/acceptance_mt_bench_8-4-3.json"
python benchmarks/report.py "$OUT"
