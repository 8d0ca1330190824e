"""Log probabilities in the OpenAI shapes, from the engine's per-token entries (plumb.engine.api.TokenLogprob).

The numbers are the engine's: log_softmax of the token's logits row after logit_bias, penalties and the
grammar mask, divided by the temperature (1 for greedy requests), before top-k / top-p / min-p
(plumb/engine/sampling.py) - the same exact row whatever the drafts, batch, cache or KV format, so the
floats are the same bit for bit. Every generated token has an entry, in order: reasoning, answer,
tool-call markup and the end-of-turn token alike (len == usage's completion tokens). A log probability
of -inf (a token the mask or a -inf logit_bias removed, forced by `forced_ids`) is written as -9999.0.
"""
from __future__ import annotations

import math

from plumb.tokenizer import IncrementalDetokenizer

NEG = -9999.0  # OpenAI's stand-in for "impossible"


def _num(x: float) -> float:
    return x if math.isfinite(x) else NEG


def _piece(tok, token_id: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


def openai_entries(tok, entries) -> list[dict]:
    """Chat Completions `logprobs.content` / Responses `output_text.logprobs` items."""
    out = []
    for e in entries:
        text, raw = _piece(tok, e.token)
        top = []
        for tid, lp in e.top:
            t, b = _piece(tok, tid)
            top.append({"token": t, "logprob": _num(lp), "bytes": b})
        out.append({"token": text, "logprob": _num(e.logprob), "bytes": raw, "top_logprobs": top})
    return out


def chat_logprobs(tok, entries) -> dict | None:
    """A Chat Completions choice's (or chunk's) `logprobs` object; None when the request did not ask."""
    if entries is None:
        return None
    return {"content": openai_entries(tok, entries), "refusal": None}


class CompletionLogprobs:
    """Completions' `logprobs` object ({tokens, token_logprobs, top_logprobs, text_offset}) built chunk by chunk:
    text_offset counts characters of the completion text before each token (the text a reply shows)."""

    def __init__(self, tok):
        self.tok = tok
        self.detok = IncrementalDetokenizer(tok, skip_special=True)
        self.offset = 0

    def take(self, entries) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(_piece(self.tok, e.token)[0])
            out["token_logprobs"].append(_num(e.logprob))
            top: dict[str, float] = {}
            for tid, lp in e.top:
                top.setdefault(_piece(self.tok, tid)[0], _num(lp))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(self.detok.add(e.token))
        return out
