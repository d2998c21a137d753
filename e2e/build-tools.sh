#!/usr/bin/env bash
# Build the pinned Go tools under e2e/tools/<name>/ and cache them by version.
#
#   e2e/build-tools.sh [NAME ...]      build (or reuse) the named tools; all when none given
#   e2e/build-tools.sh --path NAME     print the folder holding NAME's binaries (builds if needed)
#   e2e/build-tools.sh --list          print the tool names
#
# Convention: each e2e/tools/<name>/ is a Go module whose go.mod lists its binaries
# as `tool` directives (go get -tool PKG@VERSION). An optional `ldflags` file there
# holds linker flags (version stamping), one per line, '#' lines are comments.
# The cache key is a hash of go.mod, go.sum, ldflags, the Go version and the target
# platform, so a changed pin rebuilds and an unchanged one costs nothing.
# Cache root: $CKPT_TOOLS_CACHE (default ~/.cache/ckpt-operator/tools).
#
# Builds run with -mod=readonly: go.mod/go.sum as committed are the truth (a build
# that rewrote them would change its own cache key). Builds are serialized through a
# lock file in the cache root, so two callers never compile at once on a small machine.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${CKPT_TOOLS_CACHE:-$HOME/.cache/ckpt-operator/tools}"
export CGO_ENABLED=0
# Keep the caller's GOFLAGS (e.g. -buildvcs=false) but force readonly module mode.
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

command -v go >/dev/null || { echo "build-tools: 'go' not found on PATH (need Go >= 1.26: etcd's and promtool's pinned modules say go 1.26)" >&2; exit 3; }

key_of() {
  local dir="$here/tools/$1"
  { cat "$dir/go.mod" "$dir/go.sum" 2>/dev/null; cat "$dir/ldflags" 2>/dev/null
    go env GOVERSION GOOS GOARCH; } | sha256sum | cut -c1-12
}

out_of() { echo "$cache/$1-$(key_of "$1")"; }

build_one() {
  local name="$1" dir="$here/tools/$1" out tmp start
  [ -f "$dir/go.mod" ] || { echo "build-tools: no such tool module: e2e/tools/$name" >&2; return 2; }
  out="$(out_of "$name")"
  if [ -f "$out/.complete" ]; then
    echo "build-tools: $name cached at $out" >&2
    return 0
  fi
  mkdir -p "$cache"
  # One build at a time (per cache root); re-check the cache once we hold the lock.
  exec 9>"$cache/.lock"
  flock 9
  if [ -f "$out/.complete" ]; then
    echo "build-tools: $name cached at $out" >&2
    flock -u 9
    return 0
  fi
  tmp="$(mktemp -d "$cache/.$name.XXXXXX")"
  chmod 755 "$tmp"
  start=$(date +%s)
  echo "build-tools: building $name (first build on this machine may take minutes) ..." >&2
  local ldflags=""
  [ -f "$dir/ldflags" ] && ldflags="$(grep -v '^[[:space:]]*#' "$dir/ldflags" | tr '\n' ' ')"
  if ! (cd "$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$tmp/" tool); then
    rm -rf "$tmp"
    flock -u 9
    echo "build-tools: FAILED to build $name" >&2
    return 1
  fi
  echo "$(( $(date +%s) - start ))" >"$tmp/.build-seconds"
  touch "$tmp/.complete"
  rm -rf "$out"
  mv "$tmp" "$out"
  # Drop other (older) pins of this tool; running binaries keep their inode, so this is safe.
  find "$cache" -mindepth 1 -maxdepth 1 -type d -name "$name-????????????" ! -path "$out" -exec rm -rf {} +
  flock -u 9
  echo "build-tools: built $name in $(cat "$out/.build-seconds")s -> $out" >&2
}

all_names() {
  local d
  for d in "$here"/tools/*/; do
    [ -f "$d/go.mod" ] && basename "$d"
  done
}

case "${1:-}" in
  --path)
    [ $# -eq 2 ] || { echo "usage: $0 --path NAME" >&2; exit 2; }
    build_one "$2"
    out_of "$2"
    exit 0
    ;;
  --list)
    all_names
    exit 0
    ;;
esac

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < <(all_names)
fi
for n in "${names[@]}"; do build_one "$n"; done
