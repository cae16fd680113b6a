#!/usr/bin/env bash
# The BENCHMARKS.md runs on a CPU machine: one headline run (MT-bench, 40 prompts, T=0, batch 1)
# and a matrix of suites x temperature x batch on 16-prompt subsets, MT-bench acceptance on all 80
# prompts at two trees (batched: tau does not depend on batching), then the report tables.
# Every run is one `hsd bench` process (methods interleaved per batch). Rerun a single line to
# refresh one table. Results: benchmarks/results/<hardware>/*.json, figures next to them.
set -euo pipefail
cd "$(dirname "$0")/.."
HW=$(python -c "from hsd_jax.tuning import hardware_key; print(hardware_key())")
OUT=benchmarks/results/$HW
mkdir -p "$OUT"
METHODS=ar,sd,eagle,hsd
# the headline also runs HSD with the reuse policy that is not the default
OTHER=$(python -c "from hsd_jax.engine import SpecConfig; print('hsd-noreuse' if SpecConfig.reuse != 'none' else 'hsd-refresh')")

hsd bench --suite mt_bench --num-prompts 40 --max-new-tokens 128 --methods $METHODS,$OTHER,ngram \
    --json "$OUT/mt_bench_T0_b1_headline.json" --plot "$OUT/mt_bench_T0_b1_headline.png"
for suite in mt_bench humaneval gsm8k; do
  for temp in 0 1; do
    for bs in 1 4; do
      name=${suite}_T${temp}_b${bs}
      [[ $name == mt_bench_T0_b1 ]] && continue
      hsd bench --suite $suite --num-prompts 16 --max-new-tokens 64 --temperature $temp --batch-size $bs \
          --methods $METHODS --json "$OUT/$name.json" --plot "$OUT/$name.png"
    done
  done
done
python benchmarks/acceptance.py --suite mt_bench --num-prompts 80 --max-new-tokens 128 \
    --methods hsd-noreuse,hsd-refresh,hsd-chain,eagle,sd,ngram --json "$OUT/acceptance_mt_bench.json"
# the same at a wider, deeper tree (the CPU default before `hsd tune`): where depth and branching matter
python benchmarks/acceptance.py --suite mt_bench --num-prompts 80 --max-new-tokens 128 --tree-nodes 8 --tree-depth 4 \
    --top-k 3 --methods hsd-noreuse,hsd-refresh,eagle,ngram --json "$OUT/acceptance_mt_bench_8-4-3.json"
python benchmarks/report.py "$OUT"
