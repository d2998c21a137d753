#!/usr/bin/env bash
# Install everything this project needs on a fresh machine (idempotent, cached).
#
#   scripts/setup.sh            Python venv (.venv) with the project and its dev tools
#   scripts/setup.sh --tools    ... and every Go-built tool (control plane, kwok, helm, the
#                               Kubeflow operators, JobSet, MinIO, Toxiproxy, promtool;
#                               two at a time, e2e/build-tools.sh), and headless Chromium
#                               (apt) for the report test
#   scripts/setup.sh --images   ... and the operator image (scripts/build-images.sh: buildah)
#
# Needs: python3.11+ and Go >= 1.26 (both on this project's machines). Everything
# else comes from PyPI and the Go module proxy. Re-running is cheap: the venv is
# reused while pyproject.toml is unchanged and Go binaries are cached by version
# under ~/.cache/ckpt-operator/tools.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

want_tools=0
want_images=0
for a in "$@"; do
  case "$a" in
    --tools) want_tools=1 ;;
    --images) want_images=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) die "unknown option $a (try --help)" ;;
  esac
done

py="${PYTHON:-}"
if [ -z "$py" ]; then
  for c in python3.11 python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      py="$c"; break
    fi
  done
fi
[ -n "$py" ] || die "Python >= 3.11 not found; install it (apt-get install python3.11) or set PYTHON=/path/to/python"

if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $("$py" --version)"
  "$py" -m venv .venv
fi

stamp=".venv/.ckpt-installed"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing the project and dev tools into .venv (torch is large: first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
else
  log ".venv up to date"
fi

if [ "$want_tools" = 1 ]; then
  command -v go >/dev/null || die "Go >= 1.26 is needed to build the test control plane (apt's golang is too old; this project's machines ship Go)"
  if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    # headless Chromium renders `ckpt report` pages in the tests (tests/ckpt_agent/report)
    log "installing chromium (apt) for the report's browser test"
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
    if ! { $sudo_ apt-get install -y -q chromium >/dev/null 2>&1 ||
           { $sudo_ apt-get update -q >/dev/null 2>&1 && $sudo_ apt-get install -y -q chromium >/dev/null 2>&1; }; }; then
      log "warning: could not install chromium (apt-get install chromium); the browser test will skip"
    fi
  fi
  log "building/reusing the Go tools ($(e2e/build-tools.sh --list | tr '\n' ' ' | sed 's/ $//'))"
  log "a cold build takes long on 2 cores (an estimate follows); later runs reuse ~/.cache/ckpt-operator/tools"
  e2e/build-tools.sh
fi

if [ "$want_images" = 1 ]; then
  # tests/test_image.py and the e2e's operator run from it; cached by a hash of its sources
  log "building/reusing the operator image (cold: ~1.5-3 min on 2 cores, mostly the base)"
  t_img=$(date +%s)
  scripts/build-images.sh >/dev/null
  log "operator image ready in $(( $(date +%s) - t_img ))s"
fi
