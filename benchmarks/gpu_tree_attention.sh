#!/usr/bin/env bash
# Tree-attention check and benchmark on one NVIDIA GPU (H200); no downloads.
# 1. kernel-vs-reference tests (Triton variant native, TPU variant interpreted),
#    f32 matmuls at full precision so the 1e-5 tolerance applies to XLA too;
# 2. the benchmark table (bf16, Triton variant) into $OUT.
# Budget: under 5 minutes in total.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/hsd_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import jax; print(jax.__version__, jax.devices())"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 \
  python -m pytest -q tests/test_tree_attention.py -p no:cacheprovider \
  2>&1 | tail -25 | tee "$OUT/tree_attention_tests.txt"
timeout 140 python benchmarks/tree_attention.py --repeats 10 \
  --out "$OUT/tree_attention_h200.md" 2>&1 | tee "$OUT/tree_attention_bench.log"
