#!/usr/bin/env bash
# Regenerate requirements/operator.lock: every runtime dependency of the operator image
# (pyproject.toml's base dependencies + the `operator` extra), pinned, with the sha256 of
# every published file. The Dockerfile installs exactly these (`pip wheel/install
# --require-hashes -r requirements/operator.lock`), so an image build never resolves
# afresh and a tag of scripts/build-images.sh pins its dependencies.
#
#   scripts/lock-operator.sh            rewrite the lock (then rebuild the image and commit)
#
# Run it after changing the dependencies in pyproject.toml (tests/test_dockerfile.py fails
# while the lock misses one or pins a version that the pyproject no longer allows), or to
# take newer versions. It installs uv into a throw-away venv under ${TMPDIR:-/tmp} and
# removes it: neither the build nor the tests need uv. Environment: PIP_INDEX_URL (a
# package index other than PyPI), UV_VERSION (default below).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

uv_version="${UV_VERSION:-0.13.9}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "uv==$uv_version"
index=()
[ -z "${PIP_INDEX_URL:-}" ] || index=(--index-url "$PIP_INDEX_URL")
# --universal: one lock for every platform a user may build on (amd64, arm64); pip skips
# the entries whose markers do not match (colorama on Windows)
"$work/venv/bin/uv" pip compile pyproject.toml --extra operator --generate-hashes \
  --universal --python-version 3.11 --system-certs --no-cache "${index[@]}" \
  --custom-compile-command "scripts/lock-operator.sh" --output-file requirements/operator.lock \
  >/dev/null
echo "requirements/operator.lock: $(grep -c '^[a-z0-9]' requirements/operator.lock) packages" >&2
