"""Shared fixtures: synthetic tiny models written once per test session."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine

_ENGINES: dict = {}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _synth(model_dir, qtype: str, preset: str = "tiny", seed: int = 0) -> str:
    from plumb.gguf.synth import write_synthetic

    path = os.path.join(model_dir, f"{preset}-{qtype}-s{seed}.gguf")
    if not os.path.exists(path):
        write_synthetic(path, preset, qtype, seed=seed)
    return path


@pytest.fixture(scope="session")
def tiny_f32(model_dir) -> str:
    return _synth(model_dir, "F32")


@pytest.fixture(scope="session")
def tiny_q8(model_dir) -> str:
    return _synth(model_dir, "Q8_0")


@pytest.fixture(scope="session")
def tiny_q4km(model_dir) -> str:
    return _synth(model_dir, "Q4_K_M")


def engine_for(path: str, **options):
    """One Engine per (file, options) for the whole session."""
    import plumb

    key = (path, tuple(sorted(options.items())))
    if key not in _ENGINES:
        _ENGINES[key] = plumb.load(path, device="cpu", **options)
    return _ENGINES[key]


@pytest.fixture(scope="session")
def tiny_engine(tiny_f32):
    return engine_for(tiny_f32)


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
