"""Build hook: every wheel (``pip install .``, ``pip wheel .``, ``pip install <sdist>``, and the
editable install of ``make venv``) runs ``scripts/build_lib.sh`` - the same CMake build as
``make lib`` - before the package files are copied, so the custom-op library
(``fusecli/lib/libfusecli_ops.so``) is always part of the package. The rest of the metadata is in
pyproject.toml.

``FUSECLI_CUDA=0`` (CPU kernels only) and ``FUSECLI_NATIVE=0`` (portable code, for a wheel
that will run on other machines: x86-64's baseline, ARMv8-A on ARM64) are passed through to the
build script. The wheel's platform tag is the build machine's (``linux_x86_64``,
``linux_aarch64``). ``FUSECLI_ARCH=aarch64`` on an x86-64 machine cross-builds: the wheel then
holds the ARM64 library (``build/aarch64/``, from Debian's g++-aarch64-linux-gnu) and is tagged
``linux_aarch64``.
"""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
_ALIASES = {"arm64": "aarch64", "amd64": "x86_64"}


def _cross_arch() -> str | None:
    """The target architecture of a cross build (FUSECLI_ARCH other than this machine's)."""
    host = _ALIASES.get(platform.machine(), platform.machine())
    want = os.environ.get("FUSECLI_ARCH", "")
    want = _ALIASES.get(want, want)
    return want if want and want != host else None


class build_py_with_library(build_py):  # noqa: N801 - setuptools command naming
    def run(self):
        # the op-table generator runs with this (build) Python: pyproject's build requires
        # give it PyYAML
        env = dict(os.environ)
        env.setdefault("FUSECLI_GEN_PYTHON", sys.executable)
        subprocess.run(["bash", str(ROOT / "scripts" / "build_lib.sh")], check=True, env=env)
        super().run()
        arch = _cross_arch()
        if arch:  # the cross-built library replaces this machine's in the wheel
            dest = Path(self.build_lib) / "fusecli" / "lib"
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / "build" / arch / "libfusecli_ops.so", dest / "libfusecli_ops.so")


class NativeDistribution(Distribution):
    """Not pure Python: the wheel is platform-specific and installs into platlib."""

    def has_ext_modules(self):
        return True


class bdist_wheel_any_python(bdist_wheel):  # noqa: N801
    """The native library is no Python extension: one wheel serves every CPython 3."""

    def get_tag(self):
        arch = _cross_arch()
        return "py3", "none", f"linux_{arch}" if arch else super().get_tag()[2]


setup(distclass=NativeDistribution,
      cmdclass={"build_py": build_py_with_library, "bdist_wheel": bdist_wheel_any_python})
