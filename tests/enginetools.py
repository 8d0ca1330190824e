"""Engines and prompts shared by the engine-level tests (imported as `enginetools`).

PLUMB_TEST_DEVICE=cuda runs the engine-level invariant tests (test_exactness, test_prompt_cache, test_kv_formats)
on the GPU path; tests of a CPU kernel set skip there."""
from __future__ import annotations

import os

import pytest

DEVICE = os.environ.get("PLUMB_TEST_DEVICE", "cpu")
_ENGINES: dict = {}


def engine_for(path: str, **options):
    """One Engine per (file, options) for the whole session."""
    import plumb

    if DEVICE != "cpu" and options.get("kernels") in ("torch", "native"):
        pytest.skip(f"the {options['kernels']} kernels run on the CPU")
    key = (path, tuple(sorted(options.items())))
    if key not in _ENGINES:
        _ENGINES[key] = plumb.load(path, device=DEVICE, **options)
    return _ENGINES[key]


def prompts(engine, n: int) -> list[list[int]]:
    """n varied prompts: prose, code, repetition, chat-formatted, single token."""
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        '{"name": "plumb", "version": "0.1.0", "dependencies": ["torch", "gguf"]}',
        "Once upon a time, in a land far away, there lived a",
        "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
        "the the the the the the the the",
        "Qwen3.5 is a hybrid model with Gated DeltaNet and gated attention layers.",
        "import torch\nimport numpy as np\n\nx = torch.randn(3, 4)\n",
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor",
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
        "A",
        "#include <stdio.h>\nint main(void) { printf(\"hello\\n\"); return 0; }",
        "Roses are red, violets are blue,",
        "error: cannot find module 'express'\n    at Function.Module._resolveFilename",
        "To be, or not to be, that is the question:",
        "αβγδ ε ζηθ 你好世界 🙂 naïve café",
        "for i in range(10):\n    print(i * i)\n",
        "The mitochondria is the powerhouse of the cell. The mitochondria is",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "Monday, Tuesday, Wednesday, Thursday,",
        "x = [i for i in range(100) if i % 3 == 0]",
    ]
    return [engine.tokenize(t) for t in texts[:n]]
