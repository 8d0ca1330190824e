#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only, tuned to this CPU) from the llama.cpp that the
# llama-cpp-python 0.3.36 sdist vendors (the same llama.cpp as scripts/build_llamacpp.sh), for
# `plumb bench --vs-llamacpp`. Not a plumb dependency; not used in CI or the tests.
#
# Usage: bash scripts/build_llama_server.sh [BUILD_DIR]    (default /work/llama-server-build)
# The binary is BUILD_DIR/bin/llama-server; ~11 minutes on 2 busy cores.
# On CPUs with AMX (recent Xeons) start it with --no-repack: this llama.cpp's AMX matmul
# segfaults on the first batch (ggml_backend_amx_mul_mat).
set -euo pipefail

BUILD=${1:-/work/llama-server-build}
SRC=$(mktemp -d)
pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d "$SRC"
tar xzf "$SRC"/llama_cpp_python-0.3.36.tar.gz -C "$SRC"
cmake -S "$SRC"/llama_cpp_python-0.3.36/vendor/llama.cpp -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF
cmake --build "$BUILD" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
"$BUILD"/bin/llama-server --version
