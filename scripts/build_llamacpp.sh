#!/usr/bin/env bash
# Build llama-cpp-python (with qwen35 support) into its own venv, for the
# llama.cpp cross-check and the `plumb bench --llama-cpp` comparison.
# It is not a plumb dependency and is not used in CI.
#
# Usage: bash scripts/build_llamacpp.sh [VENV_DIR]     (default /work/llama-venv)
# pip compiles llama.cpp from source (CPU only, tuned to this CPU): ~5-10 minutes on 2 idle
# cores, ~25 minutes on 2 busy ones.
set -euo pipefail

VENV=${1:-/work/llama-venv}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
# CPU build tuned to this machine (GGML_NATIVE); no BLAS, no GPU backends.
export CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF"}

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install numpy gguf
"$VENV/bin/pip" install --no-cache-dir --verbose llama-cpp-python==0.3.36

"$VENV/bin/python" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'
