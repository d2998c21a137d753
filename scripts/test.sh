#!/usr/bin/env bash
# Set up everything and run every check: lint, types, import contracts, generated-file
# drift, unit tests, real-S3 tests and the end-to-end tests on a real control plane.
#
#   scripts/test.sh                 everything (what CI runs)
#   scripts/test.sh -m "not e2e"    extra arguments go to pytest
#
# Environment: CKPT_TOOLS_CACHE (Go binaries cache, default ~/.cache/ckpt-operator/tools).
# The operator image is built (scripts/build-images.sh: buildah, needs root) and the e2e
# runs the operator from it (CKPT_E2E_OPERATOR=process: from the venv; docs/testing.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

stage() { printf '\n\033[1;34m==> %s\033[0m\n' "$*"; }
t0=$(date +%s)

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
