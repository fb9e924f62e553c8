"""Build hook: every wheel (``pip install .``, ``pip wheel .``, ``pip install <sdist>``, and the
editable install of ``make venv``) runs ``scripts/build_lib.sh`` - the same CMake build as
``make lib`` - before the package files are copied, so the custom-op library
(``fusecli/lib/libfusecli_ops.so``) is always part of the package. The rest of the metadata is in
pyproject.toml.

``FUSECLI_CUDA=0`` (CPU kernels only) and ``FUSECLI_NATIVE=0`` (portable x86-64 code, for a wheel
that will run on other machines) are passed through to the build script.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class build_py_with_library(build_py):  # noqa: N801 - setuptools command naming
    def run(self):
        # the op-table generator runs with this (build) Python: pyproject's build requires
        # give it PyYAML
        env = dict(os.environ)
        env.setdefault("FUSECLI_GEN_PYTHON", sys.executable)
        subprocess.run(["bash", str(ROOT / "scripts" / "build_lib.sh")], check=True, env=env)
        super().run()


class NativeDistribution(Distribution):
    """Not pure Python: the wheel is platform-specific and installs into platlib."""

    def has_ext_modules(self):
        return True


class bdist_wheel_any_python(bdist_wheel):  # noqa: N801
    """The native library is no Python extension: one wheel serves every CPython 3."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(distclass=NativeDistribution,
      cmdclass={"build_py": build_py_with_library, "bdist_wheel": bdist_wheel_any_python})
