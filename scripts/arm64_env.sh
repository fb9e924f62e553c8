#!/usr/bin/env bash
# The ARM64 test environment, under build/arm64/ (never committed; set up once, then reused):
#   root/  an ARM64 root file system: Debian 12's arm64 CPython 3.11 and the libraries it needs
#          (apt-get download with a private apt state: scripts/debian_pkgs.sh)
#   site/  the wheels of scripts/arm64-requirements.txt for CPython 3.11 on manylinux aarch64
#          (onnxruntime's ARM64 wheel, numpy, onnx, pytest...), unpacked: the PYTHONPATH
#   python a launcher: qemu-aarch64-static runs root's python3.11 with site/ on its path
# It runs on an x86-64 Debian machine with qemu-user-static installed (make test-arm64).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV="$ROOT/build/arm64"
REQ="$ROOT/scripts/arm64-requirements.txt"
# the Debian 12 packages CPython 3.11 (with ctypes, ssl-free) and the wheels' libraries need
PKGS=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 libstdc++6
      zlib1g libexpat1 libffi8 libbz2-1.0 liblzma5 libuuid1 libcrypt1 libncursesw6 libtinfo6
      libreadline8 libsqlite3-0 libdb5.3 libnsl2 libtirpc3 libssl3 libgssapi-krb5-2
      libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 media-types)
WANT="$(cat "$REQ" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
STAMP="$ENV/.ready"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then exit 0; fi

command -v qemu-aarch64-static >/dev/null 2>&1 || {
  echo "arm64_env: qemu-aarch64-static not found: apt-get install qemu-user-static" >&2; exit 1; }
PIP="${FUSECLI_PIP:-$ROOT/.venv/bin/python -m pip}"

rm -rf "$ENV/root" "$ENV/site" "$STAMP"
mkdir -p "$ENV/wheels"
# shellcheck source=scripts/debian_pkgs.sh
source "$ROOT/scripts/debian_pkgs.sh"
debian_init
echo "arm64_env: Debian 12 arm64 packages (python3.11 and its libraries)"
fetch_pkgs bookworm arm64 "$ENV/root" "${PKGS[@]}"
echo "arm64_env: wheels for cp311 manylinux aarch64"
$PIP download -q --only-binary=:all: --platform manylinux_2_28_aarch64 --python-version 3.11 \
  --implementation cp --no-deps -d "$ENV/wheels" -r "$REQ"
mkdir -p "$ENV/site"
while read -r line; do
  pkg="${line%%#*}"; pkg="${pkg// /}"; [[ -z "$pkg" ]] && continue
  name="${pkg%%==*}"; ver="${pkg#*==}"
  norm="$(echo "$name" | tr 'A-Z-' 'a-z_')"
  whl="$(ls "$ENV/wheels" | grep -i "^${norm}-${ver}-" | head -1)"
  [[ -n "$whl" ]] || { echo "arm64_env: no wheel for $pkg in $ENV/wheels" >&2; exit 1; }
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$ENV/wheels/$whl" "$ENV/site"
done < "$REQ"
# subprocesses started with sys.executable (no binfmt_misc here) go through the launcher too
cat > "$ENV/site/sitecustomize.py" <<'PY'
import os
import sys

if os.environ.get("FUSECLI_ARM64_PYTHON"):
    sys.executable = os.environ["FUSECLI_ARM64_PYTHON"]
PY
cat > "$ENV/python" <<'SH'
#!/usr/bin/env bash
# CPython 3.11 for ARM64 under qemu-aarch64-static (scripts/arm64_env.sh)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$HERE/site${PYTHONPATH:+:$PYTHONPATH}" FUSECLI_ARM64_PYTHON="$HERE/python"
exec qemu-aarch64-static -L "$HERE/root" "$HERE/root/usr/bin/python3.11" "$@"
SH
chmod +x "$ENV/python"
# (onnxruntime itself needs an ARM64 /proc/cpuinfo to load: scripts/test_arm64.sh gives it one)
"$ENV/python" -c "import platform, numpy, onnx, yaml, click, pytest, xdist
print('arm64_env:', platform.machine(), 'python', platform.python_version(), 'numpy', numpy.__version__)"
echo "$WANT" > "$STAMP"
