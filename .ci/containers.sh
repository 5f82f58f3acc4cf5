#!/usr/bin/env bash
# The container suite (tests/containers/), as .ci/run runs it: starts a private Docker engine
# (installing Debian's docker.io and debootstrap when missing), makes the base images locally,
# builds the producer, dashboard and worker-cpu targets, and runs `docker compose --profile cpu up`
# with the suite's override. It skips, printing why, only where no engine can start here.
#
#   bash .ci/containers.sh            # after scripts/setup.sh (the project's .venv)
#
# Each step's result and time is printed as it ends ([containers] lines) and kept in
# $LMDQ_CONTAINERS_STEPS; the full build output goes to $LMDQ_CONTAINERS_BUILD_LOG. The engine's
# data root (LMDQ_DOCKER_ROOT, default /var/lib/lmdq-containers) keeps the base images and the
# build cache, so a second run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out="${LMDQ_CONTAINERS_OUT:-$(mktemp -d /tmp/lmdq-containers-XXXXXX)}"
mkdir -p "$out"
export LMDQ_CONTAINERS_STEPS="${LMDQ_CONTAINERS_STEPS:-$out/steps.txt}"
export LMDQ_CONTAINERS_BUILD_LOG="${LMDQ_CONTAINERS_BUILD_LOG:-$out/build.log}"
echo "containers: steps in $LMDQ_CONTAINERS_STEPS, build output in $LMDQ_CONTAINERS_BUILD_LOG"
start=$(date +%s)
rc=0
# one generous timeout per test: the first one also waits for every image build (fixtures)
.venv/bin/python -m pytest -m containers tests/containers -v -p no:cacheprovider --timeout 5400 || rc=$?
echo "containers: pytest exit $rc after $(( $(date +%s) - start )) s"
exit "$rc"
