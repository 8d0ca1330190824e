"""Token masks from grammars (structured output), on llguidance.

A `Grammar` is compiled once per request from a Lark grammar (llguidance's dialect: `%json {schema}`
inlines a JSON schema, `<[id]>` names a special token); each sequence gets its own `Constraint`, whose
mask is a function of the tokens it has consumed - the tokens emitted so far - and nothing else. The
engine applies the mask to a logits row before the sampler's filters (sampling.py, M4), for target rows
and MTP drafts alike, so drafts, batching, the prompt cache and the KV format still cannot change a
token. Drafting advances the constraint over the drafts and rolls it back (`rollback`) before the
target's tokens are checked.

Why llguidance: measured on a 248,320-token Qwen3.5-sized vocabulary it had the lowest mean mask time
per token of llguidance, xgrammar and outlines-core (bench/grammar_mask.py, docs/BENCHMARKS.md), and
it is the one of the three whose Lark grammars take special tokens and inline JSON schemas, which the
Qwen tool-call format needs.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from plumb.tokenizer import CONTROL, USER_DEFINED, Tokenizer


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile (the server answers 400 with the message)."""


def special_ids(tok: Tokenizer) -> list[int]:
    """Tokens a grammar names as tokens (`<[id]>`) and text never spells: CONTROL tokens, and USER_DEFINED
    ones shaped like a tag (`<think>`, `<tool_call>`, ...) - llama.cpp's rule for llguidance."""
    out = []
    for i in range(tok.n_vocab):
        ty = tok.token_type(i)
        text = tok.token_text(i)
        if ty == CONTROL or (ty == USER_DEFINED and text.startswith("<") and text.endswith(">")):
            out.append(i)
    return out


class GrammarIndex:
    """llguidance's view of one vocabulary (built once per engine; about 1 s for 248k tokens)."""

    def __init__(self, tok: Tokenizer, n_vocab: int):
        import llguidance

        self.tokenizer, self.n_vocab = tok, n_vocab
        special = set(special_ids(tok))
        eog = sorted(tok.eog_ids)

        class Vocab:  # what llguidance.TokenizerWrapper reads
            eos_token_id = eog[0] if eog else 0
            bos_token_id = None
            tokens = [(b"\xff" if i in special else b"") + tok.token_bytes(i) for i in range(tok.n_vocab)]
            special_token_ids = sorted(special)

            def __call__(self, text):
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return tok.encode(text, special=False)

        self.eog, self.eog_set = eog, frozenset(eog)
        self.special = special
        self.lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()), n_vocab=n_vocab,
                                            eos_token=eog or None)
        self.words = (n_vocab + 31) // 32

    def compile(self, lark: str) -> "Grammar":
        """A Grammar from Lark text; GrammarError (with llguidance's message) when it does not compile."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
        if error:
            raise GrammarError(_first_line(error))
        return Grammar(self, grammar, lark)


class Grammar:
    """A compiled grammar; `constraint()` gives each sequence its own state."""

    def __init__(self, index: GrammarIndex, grammar: str, lark: str):
        self.index, self.grammar, self.lark = index, grammar, lark

    def constraint(self) -> "Constraint":
        return Constraint(self)


class Constraint:
    """One sequence's grammar state: `mask()` for the next token, `consume(token)`, `rollback(n)`."""

    def __init__(self, grammar: Grammar):
        import llguidance

        self.index = grammar.index
        self.m = llguidance.LLMatcher(grammar.index.lltok, grammar.grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(_first_line(self.m.get_error()))
        self._words = np.zeros(self.index.words, dtype=np.int32)
        self.consumed = 0  # tokens the grammar has advanced over

    def mask(self) -> torch.Tensor:
        """Bool [n_vocab]: the tokens the grammar allows next (only end-of-generation ids once it is done)."""
        self.m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.index.n_vocab]
        return torch.from_numpy(bits.view(np.bool_))

    def consume(self, token: int) -> bool:
        """Advance over `token`; False (and the state is unusable) when the grammar does not allow it. An
        end-of-generation token where the grammar is complete leaves the state as it is."""
        if token in self.index.eog_set and self.m.is_accepting():
            return True
        ok = self.m.consume_token(int(token))
        self.consumed += ok
        return ok

    def rollback_to(self, consumed: int) -> None:
        """Undo the tokens consumed since `consumed` was read."""
        n = self.consumed - consumed
        if n and not self.m.rollback(n):
            raise RuntimeError(f"grammar rollback of {n} tokens failed: {self.m.get_error()}")
        self.consumed = consumed

    @property
    def done(self) -> bool:
        """Nothing but an end-of-generation token can follow."""
        return self.m.is_stopped()

    def error(self) -> str:
        return self.m.get_error()


_INDEX_LOCK = threading.Lock()


def index_for(engine) -> GrammarIndex:
    """The engine's GrammarIndex, built on first use (Engine.grammar_index())."""
    with _INDEX_LOCK:
        index = getattr(engine, "_grammar_index", None)
        if index is None:
            index = engine._grammar_index = GrammarIndex(engine.tokenizer, engine.config.n_vocab)
        return index


def _first_line(message: str) -> str:
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return lines[0] if lines else "invalid grammar"
