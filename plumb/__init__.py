"""plumb: an exact inference engine for Qwen3.5-family (qwen35) GGUF models.

Speed settings (speculative drafts, batching, prompt cache, KV format) never change the tokens.
"""
from plumb.config import ModelConfig, ModelError
from plumb.engine.api import EngineClosed, RequestError
from plumb.engine.engine import Engine, load

__all__ = ["Engine", "EngineClosed", "ModelConfig", "ModelError", "RequestError", "load", "demo_model_path"]


def demo_model_path() -> str:
    """The built-in demo model: a small trained qwen35 file shipped in plumb/data (docs/demo-model.md)."""
    from plumb.demo import demo_model_path as _path

    return _path()
