#!/usr/bin/env bash
# make test-arm64: the fused ops' kernel tests (each op against the unfused chain in onnxruntime
# and against the NumPy reference) and fused torch-joint graphs against their originals, on
# ARM64 under emulation (qemu-aarch64-static), with the cross-built library
# (FUSECLI_ARCH=aarch64 scripts/build_lib.sh) loaded into onnxruntime's ARM64 wheel
# (scripts/arm64_env.sh). Arguments replace the test list (pytest's: e.g. fusecli/ops/x -k y); FUSECLI_QEMU_CPU
# picks the emulated CPU (default neoverse-n1: ARMv8.2-A; cortex-a53 is a plain ARMv8.0-A).
#
# Why a mount namespace: onnxruntime reads /proc/cpuinfo when it loads (pytorch's cpuinfo), and
# qemu-user hands the guest this machine's x86 /proc/cpuinfo, on which that code crashes; the
# tests therefore run with an ARM64 /proc/cpuinfo for the emulated CPU bound over it, in a
# private mount namespace (unshare -m: root, as CI runs; nothing outside the namespace changes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$SECONDS
bash scripts/arm64_env.sh
FUSECLI_ARCH=aarch64 bash scripts/build_lib.sh
ENV="$ROOT/build/arm64"
CPU="${FUSECLI_QEMU_CPU:-neoverse-n1}"
# MIDR fields of the emulated CPU, as /proc/cpuinfo shows them on the real one
case "$CPU" in
  neoverse-n1) VARIANT=0x3 PART=0xd0c ;;
  cortex-a53) VARIANT=0x0 PART=0xd03 ;;
  cortex-a57) VARIANT=0x1 PART=0xd07 ;;
  cortex-a72) VARIANT=0x0 PART=0xd08 ;;
  *) echo "test_arm64: FUSECLI_QEMU_CPU=$CPU: use neoverse-n1, cortex-a53, cortex-a57 or cortex-a72" >&2
     exit 2 ;;
esac
for ((i = 0; i < $(nproc); i++)); do
  printf 'processor\t: %d\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm cpuid\n' "$i"
  printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: %s\nCPU part\t: %s\n' "$VARIANT" "$PART"
  printf 'CPU revision\t: 1\n\n'
done > "$ENV/cpuinfo"
command -v unshare >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] || {
  echo "test_arm64: needs root and unshare (util-linux) to give onnxruntime an ARM64 /proc/cpuinfo" >&2
  exit 1; }

# The kernel tests of every op folder: its test files that run the library (they import
# kernel_helpers; not flash_attention/test_tc_model.py, a NumPy model of the CUDA tensor-core
# path that loads no library) but not the GPU ones (*_gpu.py); the tests marked ortt
# (onnxruntime-training: no ARM64 wheel) are deselected, each has a stock-onnxruntime twin on
# the same cases that runs here. Then the fused torch-joint graphs (tests/test_arm64.py).
TESTS=()
for f in fusecli/ops/*/test_*.py; do
  [[ "$f" != *_gpu.py ]] && grep -q '^from kernel_helpers import' "$f" && TESTS+=("$f")
done
TESTS+=(tests/test_arm64.py)
[[ $# -gt 0 ]] && TESTS=("$@")  # arguments replace the test list
echo "test_arm64: setup $((SECONDS - T0)) s; running the tests on $CPU (qemu-aarch64-static)"
T1=$SECONDS
set +e
unshare -m --propagation private bash -c '
  mount --bind "$1" /proc/cpuinfo || exit 1
  shift
  exec "$@"' bash "$ENV/cpuinfo" \
  env FUSECLI_LIBRARY="$ROOT/build/aarch64/libfusecli_ops.so" QEMU_CPU="$CPU" \
  "$ENV/python" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" \
  -m "not gpu and not ortt and not timing" --durations=15 "${TESTS[@]}"
RC=$?
set -e
echo "test_arm64: tests took $((SECONDS - T1)) s (all: $((SECONDS - T0)) s), pytest exit $RC"
exit $RC
