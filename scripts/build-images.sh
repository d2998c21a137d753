#!/usr/bin/env bash
# Build the operator image (Dockerfile target `operator`) without a Docker engine.
#
#   scripts/build-images.sh              build it unless the image for these sources exists
#   scripts/build-images.sh --print-tag  print the image reference for the current sources
#   scripts/build-images.sh --force      rebuild even if it exists
#   scripts/build-images.sh --prune      only remove older images (keeps CKPT_IMAGE_KEEP)
#
# How: buildah (rootful, storage driver vfs, chroot isolation: no daemon, no overlayfs)
# builds the Dockerfile on a base image made here from Debian packages with mmdebstrap
# (python3 + a venv at /usr/local, so `python`/`pip` are on PATH as in python:*-slim),
# because public base images cannot be pulled on this project's machines. The Debian
# mirror and suite are this machine's (its apt configuration); this machine's CA bundle
# goes into the base so pip inside the build trusts what pip here trusts. Users build
# on the default base (python:3.11-slim): see README.md.
#
# The image is tagged by a hash of the Dockerfile, pyproject.toml, README.md, the
# dependency lock requirements/operator.lock (scripts/lock-operator.sh) and the agent/ and
# operator/ sources it copies (plus the base), so an unchanged tree skips the build. Only
# the newest CKPT_IMAGE_KEEP images of each repository stay (other trees on this machine,
# e.g. a CI clone, may be about to run theirs). Not root: runs itself again with `sudo -E`.
# buildah, mmdebstrap and acl (for the e2e) are installed with apt when missing.
#
# Environment: CKPT_IMAGE_REPO (default localhost/ckpt-operator), CKPT_IMAGE_KEEP (default
# 3), STORAGE_DRIVER (default vfs), PIP_INDEX_URL (else pip's configured index, else PyPI:
# a build argument).
set -euo pipefail
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$self")/.."

log() { printf '\033[1;34m[images]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[images] error:\033[0m %s\n' "$*" >&2; exit 1; }

repo="${CKPT_IMAGE_REPO:-localhost/ckpt-operator}"
keep="${CKPT_IMAGE_KEEP:-3}"
[[ "$keep" =~ ^[1-9][0-9]*$ ]] || die "CKPT_IMAGE_KEEP=$keep: give a number >= 1"
export STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"
export BUILDAH_ISOLATION=chroot
packages="python3,python3-venv,ca-certificates"
ca_bundle=/etc/ssl/certs/ca-certificates.crt

mode=build
for a in "$@"; do
  case "$a" in
    --print-tag) mode=print ;;
    --force) mode=force ;;
    --prune) mode=prune ;;
    -h|--help) sed -n '2,26p' "$self"; exit 0 ;;
    *) die "unknown option $a (try --help)" ;;
  esac
done

# --------------------------------------------------------------- this machine's Debian
# shellcheck disable=SC1091
suite="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
[ -n "$suite" ] || die "cannot tell this machine's Debian suite (no VERSION_CODENAME in /etc/os-release)"

# The first `deb` source of $suite in the apt configuration (one-line or deb822 format).
mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk -v s="$suite" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) while ($i !~ /\]$/) i++; if ($2 ~ /^\[/) i++;
      if ($(i + 1) == s) { print $i; exit } }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v s="$suite" 'BEGIN { RS = ""; FS = "\n" }
      { t = u = su = ""; for (j = 1; j <= NF; j++) {
          if ($j ~ /^Types:/) t = $j; if ($j ~ /^URIs:/) u = $j; if ($j ~ /^Suites:/) su = $j }
        if (t ~ /(^|[ \t])deb([ \t]|$)/ && (" " su " ") ~ (" " s " ")) {
          sub(/^URIs:[ \t]*/, "", u); split(u, w, /[ \t]+/); print w[1]; exit } }' "$f"
  done
}

hash_files() { sha256sum "$@" | sha256sum | cut -c1-16; }

sources_hash() {
  local files
  mapfile -t files < <(find agent operator -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' \
    ! -path '*.egg-info/*' | LC_ALL=C sort)
  { hash_files Dockerfile pyproject.toml README.md requirements/operator.lock "${files[@]}"
    echo "$base_tag"; } | sha256sum | cut -c1-12
}

base_recipe="$(sed -n '/^# -* base image$/,/^# -* operator image$/p' "$self")"
base_tag="localhost/ckpt-base:${suite}-$({ echo "$packages$base_recipe"; cat "$ca_bundle"; } | sha256sum | cut -c1-12)"
tag="${repo}:$(sources_hash)"
if [ "$mode" = print ]; then
  echo "$tag"
  exit 0
fi

# pip in the build uses the index pip here uses (PIP_INDEX_URL, pip's config, else PyPI),
# resolved once, as this user (before sudo: root's pip may be configured differently)
[ -n "${PIP_INDEX_URL:-}" ] || PIP_INDEX_URL="$(python3 -m pip config get global.index-url 2>/dev/null || true)"
[ -z "$PIP_INDEX_URL" ] || export PIP_INDEX_URL

# --------------------------------------------------------------- root
# rootful buildah with chroot isolation: not root, run again with sudo, keeping the
# environment (the index above included)
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || die "building images here needs root (rootful buildah with chroot isolation): run it as root"
  log "not root: running it again with sudo -E (rootful buildah)"
  exec sudo -E "$self" "$@"
fi

# --------------------------------------------------------------- tools
# (acl: setfacl, with which the e2e shares its PVC folder with the operator's fsGroup)
if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v setfacl >/dev/null; then
  command -v apt-get >/dev/null || die "buildah, mmdebstrap or setfacl is missing and there is no apt-get: install them"
  log "installing buildah, mmdebstrap and acl with apt"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq buildah mmdebstrap acl >/dev/null
fi

exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }
# the sum of the layers (uncompressed), as `docker images` shows it
size_mb() {
  buildah inspect --type image "$1" | python3 -c 'import json, sys
layers = json.loads(json.load(sys.stdin)["Manifest"])["layers"]
print(round(sum(layer["size"] for layer in layers) / 1e6))'
}

# remove the images of repository $1 (earlier source trees or base recipes) but $2 and the
# $keep - 1 newest others: another tree on this machine (a CI clone) may be about to use one
prune() {
  buildah images --format '{{.Created}} {{.Name}}:{{.Tag}}' \
    | awk -v r="$1:" 'index($2, r) == 1 { print $1, $2 }' | sort -rn | awk '{ print $2 }' \
    | { grep -vxF "$2" || true; } | tail -n +"$keep" \
    | xargs -r -n1 buildah rmi >/dev/null 2>&1 || true
}

if [ "$mode" = prune ]; then
  prune "$repo" "$tag"
  prune localhost/ckpt-base "$base_tag"
  exit 0
fi

t0=$(date +%s)
if [ "$mode" != force ] && exists "$tag"; then
  log "$tag is up to date ($(size_mb "$tag") MB)"
  echo "$tag"
  exit 0
fi

# --------------------------------------------------------------- base image
if ! exists "$base_tag"; then
  url="$(mirror | head -n1)"
  [ -n "$url" ] || die "no 'deb' source for suite $suite in /etc/apt/sources.list{,.d/*}: cannot make the base"
  log "making the base $base_tag with mmdebstrap ($suite from $url)"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  mmdebstrap --quiet --variant=minbase --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='chroot "$1" python3 -m venv /usr/local' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$suite" "$work/rootfs.tar" "deb $url $suite main"
  ctr="$(buildah from scratch)"
  buildah add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
  buildah copy --quiet "$ctr" "$ca_bundle" "$ca_bundle" >/dev/null
  buildah config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$ctr"
  buildah commit --quiet --rm "$ctr" "$base_tag" >/dev/null
  prune localhost/ckpt-base "$base_tag"
  rm -rf "$work"
  trap - EXIT
fi
ctr="$(buildah from "$base_tag")"
version="$(buildah run "$ctr" -- python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
buildah rm "$ctr" >/dev/null
python3 -c "import sys; sys.exit(tuple(map(int, '$version'.split('.'))) < (3, 11))" \
  || die "the $suite base has Python $version; the project needs >= 3.11 (use a newer Debian)"

# --------------------------------------------------------------- operator image
log "building $tag (target operator, base $base_tag, Python $version)"
args=(--build-arg "PYTHON_IMAGE=$base_tag" --build-arg "PIP_INDEX_URL=${PIP_INDEX_URL:-https://pypi.org/simple}")
buildah bud --quiet --layers=false --target operator "${args[@]}" -t "$tag" -f Dockerfile . >/dev/null
prune "$repo" "$tag"
log "built $tag in $(( $(date +%s) - t0 ))s: $(size_mb "$tag") MB"
echo "$tag"
