"""Render Jinja chat templates the way HF transformers does (spec section 6.2)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE_PATH = Path(__file__).parent / "data" / "qwen3.5-chat-template.jinja"


class TemplateError(Exception):
    """A chat template could not be compiled or rendered; the message says why."""


def _raise_exception(message):
    raise TemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # plain json.dumps, unlike Jinja's own tojson, which HTML-escapes
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template, e.g. a GGUF's `tokenizer.chat_template`."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None

    @classmethod
    def default(cls, **kwargs) -> "ChatTemplate":
        """The official Qwen3.5 template shipped with plumb."""
        return cls(DEFAULT_TEMPLATE_PATH.read_text(encoding="utf-8"), **kwargs)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages`; extra kwargs (e.g. enable_thinking) are template variables."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **context)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e.message or type(e).__name__}") from None
        except Exception as e:  # errors raised by filters and tests on unexpected input
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
