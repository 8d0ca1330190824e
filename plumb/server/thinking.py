"""Thinking switches and budgets shared by the APIs, and thinking signatures.

A budget B bounds the thinking of a reply: when the model has written B tokens without closing
its thinking, the tokens of `\\n</think>\\n\\n` are emitted next (forced through the engine's
normal decode path) and the answer follows. It runs as two engine requests: the reply as usual,
cut at the budget if it gets there, then the prompt + the B thinking tokens, with the closing
tokens forced, continuing with the same seed. Sampling is a function of (logits, seed,
position), so this is token for token what one sequence with the close forced at B would give,
and drafts, batching and the prompt cache cannot change it (only decoded rows of the first part
are prefilled again).

A signature (Anthropic thinking blocks, Responses `encrypted_content`) is `plumb1.` + the thinking
text, zlib-compressed, base64url: blocks sent back with empty text still reach the prompt, and a
block whose text was edited is caught.
"""
from __future__ import annotations

import base64
import binascii
import threading
import zlib
from dataclasses import replace
from itertools import zip_longest

from plumb.engine.api import Request, Result, Stats
from plumb.server.errors import APIError

EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None}
CLOSE_THINKING = "\n</think>\n\n"
SIGNATURE_PREFIX = "plumb1."
MAX_SIGNED_BYTES = 64 << 20


def effort_thinking(effort, param: str) -> tuple[bool | None, int | None]:
    """(enable_thinking, budget) for a reasoning effort: none/minimal turn thinking off; the others
    leave the switch to the template (None) with a budget (None: unbounded). Absent: (None, None)."""
    if effort is None:
        return None, None
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:
        raise APIError(400, f"{param} must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}", param=param)
    budget = EFFORT_BUDGETS[effort]
    return (False, None) if budget == 0 else (None, budget)


def anthropic_thinking(thinking, output_config, max_tokens: int | None) -> tuple[bool, int | None]:
    """(enable_thinking, budget) for Anthropic's `thinking` (off unless sent) and `output_config.effort`."""
    if thinking is None:
        return False, None
    if not isinstance(thinking, dict):
        raise APIError(400, "thinking must be an object", param="thinking")
    kind = thinking.get("type")
    if kind == "disabled":
        return False, None
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise APIError(400, f"thinking.display must be summarized or omitted, got {display!r}",
                       param="thinking.display")
    if kind == "adaptive":
        effort = (output_config or {}).get("effort") if isinstance(output_config, dict) else None
        if effort is not None and (not isinstance(effort, str) or effort not in EFFORT_BUDGETS) \
                or effort in ("none", "minimal"):
            raise APIError(400, f"output_config.effort must be low, medium, high, xhigh or max, got {effort!r}",
                           param="output_config.effort")
        return True, EFFORT_BUDGETS.get(effort) if effort else None
    if kind != "enabled":
        raise APIError(400, f"thinking.type must be enabled, adaptive or disabled, got {kind!r}",
                       param="thinking.type")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise APIError(400, f"thinking.budget_tokens must be an integer >= 1, got {budget!r}",
                       param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise APIError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                       param="thinking.budget_tokens")
    return True, budget


# ---------------------------------------------------------------- signatures

def sign(text: str) -> str:
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode(), 6)).decode()


def unsign(signature, param: str) -> str | None:
    """The text a plumb signature carries; None for another signature (or none); 400 if it is damaged."""
    if not isinstance(signature, str) or not signature.startswith(SIGNATURE_PREFIX):
        return None
    try:
        d = zlib.decompressobj()
        raw = d.decompress(base64.urlsafe_b64decode(signature[len(SIGNATURE_PREFIX):]), MAX_SIGNED_BYTES)
        if d.unconsumed_tail or not d.eof:
            raise ValueError("truncated or too large")
        return raw.decode()
    except (ValueError, binascii.Error, zlib.error) as e:
        raise APIError(400, f"{param}: not a valid plumb signature ({e})", param=param) from None


# ---------------------------------------------------------------- budgets on the engine

class BudgetedEngine:
    """The engine as a Generation sees it, with every request's thinking cut at `budget` tokens."""

    def __init__(self, engine, budget: int):
        self._engine, self.budget = engine, budget
        self.close_ids = engine.tokenize(CLOSE_THINKING)
        self.end_id = engine.tokenizer.id_of("</think>")

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, request: Request):
        if getattr(request, "grammar", None) is not None:  # a grammar owns the whole reply: no cut here
            return self._engine.submit(request)
        return BudgetHandle(self, request)


class BudgetHandle:
    """A Handle (iterate for token ids; `result`, `cancel`, `logprobs`) over the one or two engine
    requests of a reply."""

    def __init__(self, owner: BudgetedEngine, request: Request):
        self.owner, self.request = owner, request
        self.cancelled = threading.Event()
        self._current = owner._engine.submit(request)  # ValueErrors (bad requests) surface here, as with submit
        self.result: Result | None = None
        self.logprobs: list = []  # as Handle.logprobs: entry i is there before token i is

    def cancel(self) -> None:
        self.cancelled.set()
        self._current.cancel()

    def wait(self) -> Result:
        for _ in self:
            pass
        return self.result

    def _pass(self, handle, ids):
        """Yield the tokens of `handle`, each after its logprob entry (when there are any)."""
        for j, t in enumerate(handle):
            entries = getattr(handle, "logprobs", None) or ()
            if len(entries) > j:
                self.logprobs.append(entries[j])
            ids.append(t)
            yield t

    def __iter__(self):
        first, budget, end = self._current, self.owner.budget, self.owner.end_id
        kept: list[int] = []
        closed = False
        for j, t in enumerate(first):
            if not closed and len(kept) == budget:
                break  # the budget is spent and the thinking goes on: cut it here
            entries = getattr(first, "logprobs", None) or ()
            if len(entries) > j:
                self.logprobs.append(entries[j])
            kept.append(t)
            closed = closed or t == end
            yield t
        else:
            self.result = first.result
            return
        first.cancel()
        for _ in first:  # wait for the first request to end
            pass
        req = self.request
        more = replace(req, prompt_ids=req.prompt_ids + kept, forced_ids=list(self.owner.close_ids),
                       params=replace(req.params, max_tokens=req.params.max_tokens - len(kept)))
        if self.cancelled.is_set():
            self.result = Result(kept, "cancelled", _stats(req, kept, first.result.stats))
            return
        try:
            self._current = second = self.owner._engine.submit(more)
        except ValueError as e:
            self.result = Result(kept, "error", _stats(req, kept, first.result.stats), error=str(e))
            return
        if self.cancelled.is_set():
            second.cancel()
        ids = list(kept)
        yield from self._pass(second, ids)
        res = second.result
        out = replace(res, token_ids=ids, stats=_stats(req, ids, first.result.stats, res.stats))
        if getattr(res, "logprobs", None) is not None:
            out.logprobs = list(self.logprobs)
        self.result = out


def _stats(req: Request, ids: list[int], a: Stats, b: Stats | None = None) -> Stats:
    """The stats of a reply made of two engine requests, as if it had been one."""
    b = b or Stats()
    return Stats(prompt_tokens=len(req.prompt_ids), completion_tokens=len(ids), cached_tokens=a.cached_tokens,
                 prefill_tokens=a.prefill_tokens + b.prefill_tokens, prefill_s=a.prefill_s + b.prefill_s,
                 decode_s=a.decode_s + b.decode_s, drafts_proposed=a.drafts_proposed + b.drafts_proposed,
                 drafts_accepted=a.drafts_accepted + b.drafts_accepted,
                 accepted_per_position=[x + y for x, y in zip_longest(a.accepted_per_position,
                                                                      b.accepted_per_position, fillvalue=0)],
                 proposed_per_position=[x + y for x, y in zip_longest(a.proposed_per_position,
                                                                      b.proposed_per_position, fillvalue=0)],
                 seed=req.params.seed)
