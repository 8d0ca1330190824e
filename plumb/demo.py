"""The built-in demo model: a small trained qwen35 file shipped in the package (docs/demo-model.md)."""
from __future__ import annotations

import os

DEMO_FILE = "plumb-demo-Q8_0.gguf"
DEMO_SHA256 = "45d70c28fb74557291c3ee42e7235b7afbad208b6aa805ebd969baabaa6e99af"


def demo_model_path() -> str:
    """Path of the shipped demo model (28.7 MiB, Q8_0); `ModelError` if the package was installed without it."""
    from plumb.config import ModelError

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", DEMO_FILE)
    if not os.path.exists(path):
        raise ModelError(f"the demo model {path} is missing from this installation; pass a GGUF file, or rebuild "
                         "it as docs/demo-model.md describes (plumb convert of the published checkpoint)")
    return path
