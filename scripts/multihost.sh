#!/usr/bin/env bash
# The multi-host check by hand, on one CPU machine: two processes (3 fake CPU devices each, localhost
# coordinator, gloo collectives) form one 2x3 mesh (data across the processes, model within) and run
# `hsd bench` with ar and hsd on SmolLM2-135M; then one process with 6 devices runs the same for
# comparison. Only process 0 prints and writes its JSON. The automated version: tests/test_multihost.py.
#
# Usage: bash scripts/multihost.sh [extra hsd bench arguments]   (OUT=folder for the JSON files)
# On real clusters the same variables come from the launcher: see README "Sharded and multi-host runs".
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-multihost_results}
mkdir -p "$OUT"
PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
ARGS=(bench --suite mt_bench --num-prompts 4 --batch-size 2 --methods ar,hsd --max-new-tokens 32 --mesh 2x3 "$@")
export JAX_PLATFORMS=cpu HSD_INIT_TIMEOUT_S=${HSD_INIT_TIMEOUT_S:-120} HSD_HEARTBEAT_TIMEOUT_S=${HSD_HEARTBEAT_TIMEOUT_S:-30}

echo "# two processes, one 2x3 mesh"
pids=()
for i in 0 1; do
  XLA_FLAGS=--xla_force_host_platform_device_count=3 HSD_COORDINATOR=127.0.0.1:$PORT HSD_NUM_PROCESSES=2 \
    HSD_PROCESS_ID=$i hsd "${ARGS[@]}" --json "$OUT/two_processes.json" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

echo "# one process, the same 2x3 mesh over 6 devices"
XLA_FLAGS=--xla_force_host_platform_device_count=6 hsd "${ARGS[@]}" --json "$OUT/one_process.json"

python - "$OUT" <<'PY'
import json, sys
two, one = (json.load(open(f"{sys.argv[1]}/{n}.json"))["methods"] for n in ("two_processes", "one_process"))
for m in two:
    print(f"{m}: tau {two[m]['tau']} (one process: {one[m]['tau']}), identical to ar: {two[m]['identical_to_ar']}")
assert all(two[m]["tau"] == one[m]["tau"] for m in two), "two processes and one process disagree"
PY
