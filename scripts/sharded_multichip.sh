#!/usr/bin/env bash
# Prepared multi-chip runs of benchmarks/sharded.py: real scaling, unlike the fake CPU devices.
# Meshes are 'auto': 1x1 plus every data x model split of all devices that the heads and batch allow.
#
# One host with several GPUs, or one TPU VM (all chips in one process):
#   bash scripts/sharded_multichip.sh
# Several GPU hosts: the same command on every host, process 0's host:port as coordinator:
#   HSD_COORDINATOR=host0:8476 HSD_NUM_PROCESSES=2 HSD_PROCESS_ID=<0|1> bash scripts/sharded_multichip.sh
# A TPU pod slice (JAX finds the workers itself), on all workers at once:
#   gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \
#     --command "cd hsd-jax && HSD_DISTRIBUTED=auto bash scripts/sharded_multichip.sh"
# Only process 0 prints. Extra arguments go to every run and win (e.g. --batch 64 for a pod, --max-new-tokens 128).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-sharded_results}
mkdir -p "$OUT"
python benchmarks/sharded.py --model tiny --meshes auto --batch 16 --fake-cpu-devices 0 --json "$@" \
  | tee "$OUT/tiny.jsonl"
python benchmarks/sharded.py --model smollm2-135m --meshes auto --batch 24 --fake-cpu-devices 0 --json "$@" \
  | tee "$OUT/smollm2-135m.jsonl"
