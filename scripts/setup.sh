#!/usr/bin/env bash
# Create .venv with everything the demo and the tests need (CPU only), from the committed lock
# constraints/dev.txt: every package at the exact version written there, installed with --no-deps,
# so no new release anywhere can change what a fresh clone gets. Idempotent.
# To move a version: edit pyproject.toml's range if needed, then `bash scripts/lock.sh` (the one
# command that refreshes the lock), and commit both.
# On a laptop elsewhere, the lock's CPU torch (2.13.0+cpu) comes from PyTorch's CPU wheel index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LMDQ_VENV:-.venv}
stamp="$VENV/.lmdq-setup-$(cat pyproject.toml scripts/setup.sh constraints/dev.txt | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# pip and setuptools themselves come from the lock first (the editable build below uses them)
grep -i -E '^(pip|setuptools|wheel)==' constraints/dev.txt > "$VENV/.lmdq-bootstrap.txt"
pip install --no-deps -r "$VENV/.lmdq-bootstrap.txt"
pip install --no-deps -r constraints/dev.txt
# lmdq itself and the lab (lmdq-bench, bench/), editable, built with the locked setuptools (no isolated
# build env that would float)
pip install --no-deps --no-build-isolation -e .
pip install --no-deps --no-build-isolation -e ./bench   # after lmdq: replacing lmdq must not take its script
rm -f "$VENV"/.lmdq-setup-*
touch "$stamp"
