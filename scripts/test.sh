#!/usr/bin/env bash
# Set up everything and run every check: lint, types, import contracts, generated-file
# drift, unit tests, real-S3 tests and the end-to-end tests on a real control plane.
#
#   scripts/test.sh                 everything (what CI runs)
#   scripts/test.sh -m "not e2e"    extra arguments go to pytest
#   scripts/test.sh --stress ...    the stress check instead (scripts/stress.sh: a CPU hog
#                                   on every core, shuffled order; not CI's timed path)
#
# Needs root (the image build and the e2e's operator-from-the-image) and free disk: about
# 8 GiB for the checkout and a new .venv, 4 GiB in $TMPDIR (checked first).
# Environment: CKPT_TOOLS_CACHE (Go binaries cache, default ~/.cache/ckpt-operator/tools).
# The operator image is built (scripts/build-images.sh: buildah, needs root) and the e2e
# runs the operator from it (CKPT_E2E_OPERATOR=process: from the venv; docs/testing.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ "${1:-}" == --stress ]]; then
  shift
  exec scripts/stress.sh "$@"
fi

stage() { printf '\n\033[1;34m==> %s\033[0m\n' "$*"; }
t0=$(date +%s)

# Disk first: a full disk fails late and obscurely (pip's "No space left on device" after
# minutes, or checkpoints that are never committed in a test that waits for them).
need_gib() {  # need_gib DIR GIB WHAT
  local avail
  avail=$(df -Pk "$1" | awk 'NR == 2 { print int($4 / 1048576) }')
  if (( avail < $2 )); then
    printf 'error: %s GiB free in %s; %s needs about %s GiB. Free space (old clones and their .venv, /tmp/pytest-of-*, ~/.cache/go-build) and run again.\n' \
      "$avail" "$1" "$3" "$2" >&2
    exit 1
  fi
}
if [[ -d .venv ]]; then need_gib . 2 "the checkout"; else need_gib . 8 "the checkout and its new .venv (torch)"; fi
need_gib "${TMPDIR:-/tmp}" 4 "the tests' temporary files"

stage "setup (venv + Go tools + operator image)"
scripts/setup.sh --tools --images
# the image tests and the e2e's operator-from-the-image must run here, never skip
export CKPT_REQUIRE_IMAGE=1
export PATH="$PWD/.venv/bin:$PATH"

stage "ruff (lint + format)"
ruff check .
ruff format --check .

stage "mypy --strict"
mypy

stage "import contracts (operator has no torch, agent has no kopf, pure logic has no I/O)"
lint-imports

stage "generated CRDs match the models"
python -m ckpt_agent.policy.crdgen --check

stage "pytest (${CKPT_TEST_WORKERS:-2} workers)"
# Two lanes (pytest-xdist): the torch.distributed tests stay in one (conftest.py);
# CKPT_TEST_WORKERS=0 runs everything in this process.
python -m pytest -n "${CKPT_TEST_WORKERS:-2}" --dist loadgroup "$@"

printf '\n\033[1;32mall checks passed in %ss\033[0m\n' "$(( $(date +%s) - t0 ))"
