#!/usr/bin/env bash
# Fetch build-time headers for fusecli's custom-op library into build/deps/ (never committed):
#   - onnxruntime C/C++ headers from Debian 13 (trixie) libonnxruntime-dev
#   - Eigen 3.4 headers from Debian 12 (bookworm) libeigen3-dev
# Downloaded with a private apt state (scripts/debian_pkgs.sh). Idempotent: runs once, then exits early.
# (Header-only packages: the amd64 ones serve an ARM64 cross build as well.)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS="$ROOT/build/deps"
ORT_INC="$DEPS/onnxruntime/usr/include/onnxruntime"
EIGEN_INC="$DEPS/eigen/usr/include/eigen3"

if [[ -f "$ORT_INC/onnxruntime_cxx_api.h" && -f "$EIGEN_INC/Eigen/Core" \
      && -f "$EIGEN_INC/unsupported/Eigen/SpecialFunctions" ]]; then
  exit 0
fi

# shellcheck source=scripts/debian_pkgs.sh
source "$ROOT/scripts/debian_pkgs.sh"
debian_init

mkdir -p "$DEPS"
if [[ ! -f "$ORT_INC/onnxruntime_cxx_api.h" ]]; then
  echo "fetch_deps: onnxruntime headers (trixie libonnxruntime-dev)"
  fetch_pkg trixie amd64 libonnxruntime-dev "$DEPS/onnxruntime"
fi
if [[ ! -f "$EIGEN_INC/Eigen/Core" || ! -f "$EIGEN_INC/unsupported/Eigen/SpecialFunctions" ]]; then
  echo "fetch_deps: Eigen 3.4 headers (bookworm libeigen3-dev)"
  fetch_pkg bookworm amd64 libeigen3-dev "$DEPS/eigen"
fi
test -f "$ORT_INC/onnxruntime_cxx_api.h"
test -f "$EIGEN_INC/Eigen/Core"
echo "fetch_deps: headers in $DEPS"
