#!/usr/bin/env bash
# Build the pinned Go tools under e2e/tools/<name>/ and cache them by version.
#
#   e2e/build-tools.sh [NAME ...]      build (or reuse) the named tools; all when none given
#   e2e/build-tools.sh --path NAME     print the folder holding NAME's binaries (builds if needed)
#   e2e/build-tools.sh --list          print the tool names
#   e2e/build-tools.sh --estimate [NAME ...]  print what a build would cost now, build nothing
#   -j N / --jobs N (or CKPT_TOOLS_JOBS): builds at once in one call (default 2)
#
# Convention: each e2e/tools/<name>/ is a Go module whose go.mod lists its binaries
# as `tool` directives (go get -tool PKG@VERSION). An optional `ldflags` file there
# holds linker flags (version stamping), one per line, '#' lines are comments.
# The cache key is a hash of go.mod, go.sum, ldflags, the Go version and the target
# platform, so a changed pin rebuilds and an unchanged one costs nothing.
# Cache root: $CKPT_TOOLS_CACHE (default ~/.cache/ckpt-operator/tools).
#
# Builds run with -mod=readonly: go.mod/go.sum as committed are the truth (a build
# that rewrote them would change its own cache key). Every tool shares Go's build cache
# (GOCACHE) and module cache (GOMODCACHE): both are Go's per-user defaults unless the
# caller sets them, and both are safe for concurrent builds.
#
# Concurrency and the lock: a call that has tools to build holds the lock file in the
# cache root for the whole batch, so two callers never compile at once on a small machine
# (a second caller waits, and returns as soon as the tools *it* asked for are complete, even
# while the first caller's batch goes on). Inside the batch up to --jobs tools build at
# once, the longest first: one Go build leaves cores idle in its serial phases (module
# loading, the big packages, linking), a second fills them. Before a cold build it prints an
# estimate (this machine's own earlier build times, else the defaults below), and while
# building a progress line every 60 s. Each tool's output goes to its log, shown on failure.
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

# out_of's answers, filled in the main shell by remember (subshells inherit them; each
# key_of runs `go env`, slow on a loaded machine)
declare -A known_out=()
out_of() { echo "${known_out[$1]:-$cache/$1-$(key_of "$1")}"; }
remember() { local n; for n in "$@"; do known_out[$n]="$(out_of "$n")"; done; }

# Seconds a cold build of each tool took on a loaded 2-core machine (issue #29; measured
# beside other work), used for the estimate until this machine has built it once
# ($cache/.seconds/<name>, written after every build).
default_seconds() {
  case "$1" in
    kubernetes) echo 1186 ;; jobset) echo 606 ;; minio) echo 600 ;; promtool) echo 450 ;;
    kwok) echo 359 ;; trainer) echo 320 ;; helm) echo 284 ;; etcd) echo 201 ;;
    training-operator) echo 166 ;; toxiproxy) echo 60 ;; kueue) echo 300 ;; *) echo 300 ;;
  esac
}

expected_of() {
  local f="$cache/.seconds/$1"
  if [ -s "$f" ]; then cat "$f"; else default_seconds "$1"; fi
}

is_built() { [ -f "$(out_of "$1")/.complete" ]; }

mins() { printf '%dm%02ds' $(( $1 / 60 )) $(( $1 % 60 )); }

# The tools of "$@" not built yet, longest expected build first.
missing_of() {
  local n
  for n in "$@"; do
    [ -f "$here/tools/$n/go.mod" ] || { echo "build-tools: no such tool module: e2e/tools/$n" >&2; return 2; }
    is_built "$n" || echo "$(expected_of "$n") $n"
  done | sort -rn | cut -d' ' -f2
}

estimate() {  # estimate NAME...: one line per tool and the total, to stderr
  local n s total=0 longest=0
  [ $# -gt 0 ] || { echo "build-tools: nothing to build: every tool asked for is cached" >&2; return 0; }
  for n in "$@"; do
    s=$(expected_of "$n"); total=$(( total + s )); (( s > longest )) && longest=$s
    if [ -s "$cache/.seconds/$n" ]; then
      echo "build-tools:   $n ~$(mins "$s") (its last build here)" >&2
    else
      echo "build-tools:   $n ~$(mins "$s") (a loaded 2-core machine's)" >&2
    fi
  done
  if (( $# == 1 || jobs == 1 )); then
    echo "build-tools: cold build of $# tool(s): about $(mins "$total")" >&2
  else
    echo "build-tools: cold build of $# tool(s): about $(mins "$total") one after another;" \
      "$jobs at a time: between $(mins "$longest") and that (they share $(nproc) core(s))" >&2
  fi
}

build_tool() {  # build_tool NAME LOG: the build itself (the caller holds the lock)
  local name="$1" log="$2" dir="$here/tools/$1" out tmp start ldflags=""
  out="$(out_of "$name")"
  tmp="$(mktemp -d "$cache/.$name.XXXXXX")"
  chmod 755 "$tmp"
  start=$(date +%s)
  [ -f "$dir/ldflags" ] && ldflags="$(grep -v '^[[:space:]]*#' "$dir/ldflags" | tr '\n' ' ')"
  if ! (cd "$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$tmp/" tool) >"$log" 2>&1; then
    rm -rf "$tmp"
    return 1
  fi
  echo "$(( $(date +%s) - start ))" >"$tmp/.build-seconds"
  mkdir -p "$cache/.seconds"
  cp "$tmp/.build-seconds" "$cache/.seconds/$name"
  touch "$tmp/.complete"
  rm -rf "$out"
  mv -T "$tmp" "$out"
  # Drop other (older) pins of this tool; running binaries keep their inode, so this is safe.
  find "$cache" -mindepth 1 -maxdepth 1 -type d -name "$name-????????????" ! -path "$out" -exec rm -rf {} +
}

progress() {  # progress RUNDIR N LEADER: a line every 60 s while the batch (LEADER) runs
  local run="$1" total="$2" leader="$3" f n now done_ building nap
  # sleep in the background: a TERM then ends this at once (bash defers it during a
  # foreground child), and takes the sleep along (it would hold the caller's stderr open)
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep 60 & nap=$!
    wait "$nap"
    kill -0 "$leader" 2>/dev/null || exit 0  # the batch was killed: no orphan ticker
    now=$(date +%s); done_=$(find "$run" -name '*.rc' | wc -l); building=""
    for f in "$run"/*.start; do
      [ -e "$f" ] || continue
      n=$(basename "$f" .start)
      [ -e "$run/$n.rc" ] && continue
      building+=" $n $(mins $(( now - $(cat "$f") )))/~$(mins "$(expected_of "$n")")"
    done
    echo "build-tools: [$done_/$total done] building:${building:- (starting)}" >&2
  done
}

build_all() {  # build_all NAME...: build what is missing (concurrently, under the lock)
  local todo n rc=0 run ticker="" running=0
  for n in "$@"; do
    [ -f "$here/tools/$n/go.mod" ] || { echo "build-tools: no such tool module: e2e/tools/$n" >&2; return 2; }
  done
  remember "$@"
  mapfile -t todo < <(missing_of "$@")
  for n in "$@"; do is_built "$n" && echo "build-tools: $n cached at $(out_of "$n")" >&2; done
  [ ${#todo[@]} -gt 0 ] || return 0
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  # One batch at a time (per cache root); a waiter leaves once its own tools are complete.
  local waited=0
  until flock -w 10 9; do
    mapfile -t todo < <(missing_of "$@")
    if [ ${#todo[@]} -eq 0 ]; then
      for n in "$@"; do echo "build-tools: $n cached at $(out_of "$n")" >&2; done
      return 0
    fi
    (( waited++ % 6 == 0 )) && echo "build-tools: waiting for another build (lock $cache/.lock) ..." >&2
  done
  mapfile -t todo < <(missing_of "$@")  # re-check once we hold the lock
  if [ ${#todo[@]} -eq 0 ]; then flock -u 9; return 0; fi
  estimate "${todo[@]}"
  run="$(mktemp -d "$cache/.run.XXXXXX")"
  # (the ticker does not hold the lock; the builds do, as the old serial build did: a
  # killed caller's go builds keep it until they end, so no second build races them)
  progress "$run" "${#todo[@]}" "$$" 9>&- & ticker=$!
  for n in "${todo[@]}"; do
    while (( running >= jobs )); do wait -n 2>/dev/null || true; running=$(jobs -rp | grep -cv "^$ticker$" || true); done
    echo "build-tools: building $n (~$(mins "$(expected_of "$n")")) ..." >&2
    date +%s >"$run/$n.start"
    ( if build_tool "$n" "$run/$n.log"; then
        echo 0 >"$run/$n.rc"
        echo "build-tools: built $n in $(cat "$(out_of "$n")/.build-seconds")s -> $(out_of "$n")" >&2
      else
        echo 1 >"$run/$n.rc"
        cp "$run/$n.log" "$cache/.$n.failed.log" 2>/dev/null || true
        tail -n 40 "$run/$n.log" >&2
        echo "build-tools: FAILED to build $n (log: $cache/.$n.failed.log)" >&2
      fi ) &
    running=$(( running + 1 ))
  done
  while (( $(jobs -rp | grep -cv "^$ticker$" || true) > 0 )); do wait -n 2>/dev/null || true; done
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  for n in "${todo[@]}"; do [ "$(cat "$run/$n.rc" 2>/dev/null)" = 0 ] || rc=1; done
  rm -rf "$run"
  flock -u 9
  return $rc
}

all_names() {
  local d
  for d in "$here"/tools/*/; do
    [ -f "$d/go.mod" ] && basename "$d"
  done
}

jobs="${CKPT_TOOLS_JOBS:-2}"
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) jobs="$2"; shift 2 ;;
    --jobs=*) jobs="${1#--jobs=}"; shift ;;
    *) break ;;
  esac
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "build-tools: --jobs wants a positive number, got '$jobs'" >&2; exit 2; }

case "${1:-}" in
  --path)
    [ $# -eq 2 ] || { echo "usage: $0 --path NAME" >&2; exit 2; }
    build_all "$2"
    out_of "$2"
    exit 0
    ;;
  --list)
    all_names
    exit 0
    ;;
  --estimate)
    shift
    names=("$@")
    [ ${#names[@]} -gt 0 ] || mapfile -t names < <(all_names)
    remember "${names[@]}"
    mapfile -t todo < <(missing_of "${names[@]}")
    estimate "${todo[@]}"
    exit 0
    ;;
esac

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < <(all_names)
fi
build_all "${names[@]}"
