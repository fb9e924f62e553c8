# Cross build of the custom-op library for ARM64 (Linux, glibc) on an x86-64 machine with
# Debian's g++-aarch64-linux-gnu: scripts/build_lib.sh passes this file when FUSECLI_ARCH=aarch64.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# headers come from FUSECLI_DEPS (header-only, any architecture); libraries and programs from
# the cross toolchain's own sysroot
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
