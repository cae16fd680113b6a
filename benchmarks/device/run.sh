#!/usr/bin/env bash
# The accelerator run pack: one entry. Flags: --parts LIST, --out DIR, --dry-run, --budget-s S,
# --model GGUF, --prompts FILE (see benchmarks/device/README.md for the staging on a lent GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# XLA on a GPU grabs 75% of its memory up front by default; the parts run one after another.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}"
exec python3 benchmarks/device/pack.py "$@"
