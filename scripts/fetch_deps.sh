#!/usr/bin/env bash
# Fetch build-time headers for fusecli's custom-op library into build/deps/ (never committed):
#   - onnxruntime C/C++ headers from Debian 13 (trixie) libonnxruntime-dev
#   - Eigen 3.4 headers from Debian 12 (bookworm) libeigen3-dev
# Uses a private apt state (own sources list, lists, cache) so the system's apt state is untouched.
# The archive URI is read from this machine's own apt sources. Idempotent: runs once, then exits early.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS="$ROOT/build/deps"
ORT_INC="$DEPS/onnxruntime/usr/include/onnxruntime"
EIGEN_INC="$DEPS/eigen/usr/include/eigen3"

if [[ -f "$ORT_INC/onnxruntime_cxx_api.h" && -f "$EIGEN_INC/Eigen/Core" \
      && -f "$EIGEN_INC/unsupported/Eigen/SpecialFunctions" ]]; then
  exit 0
fi

archive_uri() {
  local f uri
  # deb822 sources: first URIs: line of a non-security paragraph.
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    uri="$(awk 'BEGIN{RS=""; FS="\n"}
      { u=""; s=""
        for (i=1;i<=NF;i++) { if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/,"",$i); split($i,a,/[ \t]+/); u=a[1] }
                              if ($i ~ /^Suites:/) s=$i }
        if (u != "" && u !~ /security/ && s !~ /security/) { print u; exit } }' "$f")"
    if [[ -n "$uri" ]]; then echo "$uri"; return 0; fi
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f "$f" ]] || continue
    uri="$(awk '$1=="deb" { for (i=2;i<=NF;i++) if ($i ~ /^[a-z+]+:\/\//) { if ($i !~ /security/) { print $i; exit } ; break } }' "$f")"
    if [[ -n "$uri" ]]; then echo "$uri"; return 0; fi
  done
  return 1
}

for tool in apt-get dpkg; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "fetch_deps: '$tool' not found; the headers come from Debian packages (put them in $DEPS by hand elsewhere)" >&2
    exit 1; }
done
URI="$(archive_uri)" || { echo "fetch_deps: no Debian archive URI found in the apt sources" >&2; exit 1; }
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

apt_private() {  # $1 = suite, rest = apt-get args
  local suite="$1"; shift
  local st="$TMP/$suite"
  mkdir -p "$st/lists/partial" "$st/cache/archives/partial"
  echo "deb [signed-by=$KEYRING] $URI $suite main" > "$st/sources.list"
  local opts=(
    -o Dir::Etc::SourceList="$st/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o Dir::State::Lists="$st/lists" -o Dir::Cache="$st/cache"
    -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
    -o APT::Architectures=amd64 -o Acquire::Languages=none
    -o Acquire::IndexTargets::deb::Contents-deb::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::Contents-udeb::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::CNF::DefaultEnabled=false
    -o Debug::NoLocking=true -o APT::Sandbox::User=root
  )
  apt-get -q "${opts[@]}" "$@"
}

fetch_pkg() {  # suite package destdir
  local suite="$1" pkg="$2" dest="$3"
  [[ -f "$TMP/$suite/updated" ]] || { apt_private "$suite" update >/dev/null; touch "$TMP/$suite/updated"; }
  mkdir -p "$TMP/dl-$pkg"
  (cd "$TMP/dl-$pkg" && apt_private "$suite" download "$pkg:amd64" >/dev/null)
  rm -rf "$dest"; mkdir -p "$dest"
  dpkg -x "$TMP/dl-$pkg"/*.deb "$dest"
}

mkdir -p "$DEPS"
if [[ ! -f "$ORT_INC/onnxruntime_cxx_api.h" ]]; then
  echo "fetch_deps: onnxruntime headers (trixie libonnxruntime-dev)"
  fetch_pkg trixie libonnxruntime-dev "$DEPS/onnxruntime"
fi
if [[ ! -f "$EIGEN_INC/Eigen/Core" || ! -f "$EIGEN_INC/unsupported/Eigen/SpecialFunctions" ]]; then
  echo "fetch_deps: Eigen 3.4 headers (bookworm libeigen3-dev)"
  fetch_pkg bookworm libeigen3-dev "$DEPS/eigen"
fi
test -f "$ORT_INC/onnxruntime_cxx_api.h"
test -f "$EIGEN_INC/Eigen/Core"
echo "fetch_deps: headers in $DEPS"
