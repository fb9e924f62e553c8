#!/usr/bin/env bash
# Build fusecli's onnxruntime custom-op library (CPU kernels, plus CUDA kernels when nvcc is
# found) into build/cmake and copy it to fusecli/lib/libfusecli_ops.so. Quick when nothing changed.
#   FUSECLI_CUDA=0     force a CPU-only build
#   FUSECLI_NATIVE=0   do not tune for this machine's CPU (portable build: x86-64's baseline, or
#                      ARMv8-A on ARM64)
#   FUSECLI_ARCH=aarch64  on an x86-64 machine: cross-build the ARM64 library (Debian's
#                      g++-aarch64-linux-gnu; CPU kernels only, portable ARMv8-A) into
#                      build/aarch64/libfusecli_ops.so (`make lib-arm64`); fusecli/lib is untouched.
#                      On an ARM64 machine a plain build is native (-mcpu=native) and goes to fusecli/lib.
#                      The cross build fails when the library needs a newer glibc than GLIBC_FLOOR_AARCH64.
set -euo pipefail
# the oldest glibc the cross-built ARM64 library must load on: onnxruntime 1.31.1's aarch64 wheel
# is manylinux_2_28 (its libonnxruntime.so needs GLIBC_2.28), so below that fusecli is of no use
GLIBC_FLOOR_AARCH64=2.28
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
for tool in cmake c++; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "build_lib: '$tool' not found; building the custom-op library needs cmake and g++" >&2
    exit 1; }
done

HOST_ARCH="$(uname -m)"
ARCH="${FUSECLI_ARCH:-$HOST_ARCH}"
[[ "$ARCH" == arm64 ]] && ARCH=aarch64
[[ "$ARCH" == amd64 ]] && ARCH=x86_64
BUILD="$ROOT/build/cmake"
OUT="fusecli/lib/libfusecli_ops.so"
NM=nm
CROSS_ARGS=()
GLIBC_FLOOR=""  # checked for the cross build only: a native build is for the glibc it runs on
CUDA_OPT="${FUSECLI_CUDA:-ON}"; [[ "$CUDA_OPT" == 0 ]] && CUDA_OPT=OFF; [[ "$CUDA_OPT" == 1 ]] && CUDA_OPT=ON
NATIVE_OPT="${FUSECLI_NATIVE:-ON}"; [[ "$NATIVE_OPT" == 0 ]] && NATIVE_OPT=OFF; [[ "$NATIVE_OPT" == 1 ]] && NATIVE_OPT=ON
if [[ "$ARCH" != "$HOST_ARCH" ]]; then
  [[ "$ARCH" == aarch64 && "$HOST_ARCH" == x86_64 ]] || {
    echo "build_lib: cannot build for FUSECLI_ARCH=$ARCH on $HOST_ARCH (cross builds: aarch64 on x86_64)" >&2
    exit 1; }
  command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || {
    echo "build_lib: aarch64-linux-gnu-g++ not found; the ARM64 cross build needs Debian's" \
      "g++-aarch64-linux-gnu (apt-get install g++-aarch64-linux-gnu)" >&2
    exit 1; }
  BUILD="$ROOT/build/cmake-aarch64"
  OUT="build/aarch64/libfusecli_ops.so"
  NM=aarch64-linux-gnu-nm
  GLIBC_FLOOR="$GLIBC_FLOOR_AARCH64"
  CROSS_ARGS=(-DCMAKE_TOOLCHAIN_FILE="$ROOT/fusecli/csrc/toolchain-aarch64.cmake")
  CUDA_OPT=OFF NATIVE_OPT=OFF  # no CUDA toolkit for the target; the target CPU is not this one
fi
bash scripts/fetch_deps.sh

NVCC_ARGS=()
if [[ "$CUDA_OPT" == ON ]]; then
  NVCC="${CUDACXX:-$(command -v nvcc || true)}"
  [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
  [[ -n "$NVCC" ]] && NVCC_ARGS=(-DCMAKE_CUDA_COMPILER="$NVCC")
fi

# the op-table generator (fusecli/csrc/gen_op_tables.py) needs a Python with PyYAML:
# FUSECLI_GEN_PYTHON (pip's build hook passes its own), else the project venv's, else python3
has_yaml() { [[ -x "$1" ]] && "$1" -c "import yaml" >/dev/null 2>&1; }
PYTHON_FOR_GEN="${FUSECLI_GEN_PYTHON:-}"
if [[ -z "$PYTHON_FOR_GEN" ]]; then
  for cand in "$ROOT/.venv/bin/python" "$(command -v python3 || true)"; do
    if has_yaml "$cand"; then PYTHON_FOR_GEN="$cand"; break; fi
  done
fi
has_yaml "$PYTHON_FOR_GEN" || {
  echo "build_lib: no Python with PyYAML for the op-table generator; set FUSECLI_GEN_PYTHON" >&2
  exit 1; }

GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
STAMP="$BUILD/.fusecli-config"
PY_STAMP="$BUILD/.fusecli-python"
WANT="arch=$ARCH cuda=$CUDA_OPT native=$NATIVE_OPT nvcc=${NVCC_ARGS[*]:-none} gen=${GEN[*]:-make}"
if [[ ! -f "$BUILD/CMakeCache.txt" || "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
  rm -rf "$BUILD"
fi
# another generator Python (pip's temporary build env, then the venv's) only reconfigures: the
# generator rewrites a table only when its text changes, so nothing is recompiled
if [[ ! -f "$BUILD/CMakeCache.txt" || "$(cat "$PY_STAMP" 2>/dev/null)" != "$PYTHON_FOR_GEN" ]]; then
  cmake -S fusecli/csrc -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DFUSECLI_DEPS="$ROOT/build/deps" -DFUSECLI_CUDA="$CUDA_OPT" -DFUSECLI_NATIVE="$NATIVE_OPT" \
    -DPython3_EXECUTABLE="$PYTHON_FOR_GEN" \
    "${NVCC_ARGS[@]}" "${CROSS_ARGS[@]}" >/dev/null
  echo "$WANT" > "$STAMP"
  echo "$PYTHON_FOR_GEN" > "$PY_STAMP"
fi
JOBS="$(nproc 2>/dev/null || echo 2)"
cmake --build "$BUILD" -j "$JOBS" -- $([[ ${#GEN[@]} -eq 0 ]] && echo --no-print-directory) >/dev/null
mkdir -p "$(dirname "$OUT")"
SO="$BUILD/libfusecli_ops.so"
if ! cmp -s "$SO" "$OUT" 2>/dev/null; then
  cp "$SO" "$OUT.tmp" && mv -f "$OUT.tmp" "$OUT"
fi
if "$NM" -D --defined-only "$OUT" | grep -c fusecli_launch_ >/dev/null; then
  KIND="CPU + CUDA kernels"
else
  KIND="CPU kernels only"
fi
# the glibc versions the dynamic loader will ask for (the GLIBC_ entries of .gnu.version_r)
if [[ -n "$GLIBC_FLOOR" ]]; then
  NEED="$("${NM%nm}readelf" -V -W "$OUT" | grep -oE 'Name: GLIBC_[0-9.]+' | sed 's/Name: GLIBC_//' | sort -Vu)"
  TOP="$(tail -n 1 <<<"$NEED")"
  if [[ "$(printf '%s\n%s\n' "$TOP" "$GLIBC_FLOOR" | sort -V | tail -n 1)" != "$GLIBC_FLOOR" ]]; then
    echo "build_lib: $OUT needs glibc $TOP, newer than the floor $GLIBC_FLOOR" \
      "(GLIBC_FLOOR_AARCH64, docs/arm64.md); symbols above it:" >&2
    "${NM%nm}objdump" -T "$OUT" | grep -E 'GLIBC_[0-9.]+' | awk -v f="$GLIBC_FLOOR" '{
      v = $0; sub(/.*GLIBC_/, "", v); sub(/[) ].*/, "", v)
      split(v, a, "."); split(f, b, ".")
      if (a[1] + 0 > b[1] + 0 || (a[1] + 0 == b[1] + 0 && a[2] + 0 > b[2] + 0)) print "  " $NF " GLIBC_" v
    }' >&2
    exit 1
  fi
  GLIBC_NOTE=", needs glibc >= ${TOP:-?}"
fi
echo "built $OUT ($ARCH, $KIND${GLIBC_NOTE:-})"
