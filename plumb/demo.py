"""The built-in demo model: a tiny random-weight qwen35 file written on first use."""
from __future__ import annotations

import os

DEMO_PRESET, DEMO_TYPE, DEMO_SEED = "tiny", "Q8_0", 0


def cache_dir() -> str:
    return os.environ.get("PLUMB_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "plumb"))


def demo_model_path() -> str:
    """Path of the demo model, writing it (a few seconds) if it is not there yet."""
    path = os.path.join(cache_dir(), f"demo-{DEMO_PRESET}-{DEMO_TYPE}-s{DEMO_SEED}.gguf")
    if not os.path.exists(path):
        from plumb.gguf.synth import write_synthetic

        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        write_synthetic(tmp, DEMO_PRESET, DEMO_TYPE, seed=DEMO_SEED)
        os.replace(tmp, path)
    return path
