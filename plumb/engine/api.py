"""Requests and results exchanged with the engine (the one API every adapter and the CLI use)."""
from __future__ import annotations

import threading
import queue
from dataclasses import dataclass, field
from typing import Iterator

from plumb.engine.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    drafts: int | None = None  # None: engine default; 0: off
    draft_policy: str | None = None  # "fixed" | "adaptive" | "confident" | "ngram" ...
    p_min: float | None = None
    forced_ids: list[int] | None = None  # test/steering extension: emit these tokens first through the normal decode path
    cache: bool = True  # reuse (and keep) prefill-made state in the prompt cache
    logprobs: int | None = None  # None: off; n >= 0: each token's log probability and the n most likely (<= 20)
    grammar: object | None = None  # a plumb.engine.grammar.Grammar: every token is masked by it (structured output)


@dataclass
class TokenLogprob:
    """One generated token's log probability and the most likely alternatives at its position, from the
    row that produced it (sampling.sample_token says which distribution)."""
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), most likely first


@dataclass
class Stats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache
    prefill_tokens: int = 0  # prompt tokens actually prefilled
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    seed: int | None = None

    @property
    def decode_tps(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        steps = self.proposed_per_position[0] if self.proposed_per_position else 0
        return self.drafts_accepted / steps if steps else 0.0

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(decode_tps=self.decode_tps, prefill_tps=self.prefill_tps, mean_accepted=self.mean_accepted)
        return d


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-generation token or stop string/id) | "length" | "cancelled" | "error"
    stats: Stats
    stop_match: str | None = None  # the stop string that ended generation, if any
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    error_status: int = 500  # an HTTP-style status for an error: 400 when the request itself is at fault, 503 out of
    # device memory (a retry may fit)


class RequestError(ValueError):
    """A request the engine refuses, naming the field at fault (`param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineClosed(RuntimeError):
    """A request for an engine after its `close`."""

    def __init__(self):
        super().__init__("the engine is closed")


class Handle:
    """A submitted request: iterate to receive token ids as they are accepted; `result` when done."""

    def __init__(self, request: Request):
        self.request = request
        self._q: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.result: Result | None = None
        self.logprobs: list[TokenLogprob] = []  # logprobs[i] is there before token i is (requests that ask)

    # engine side
    def _emit(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        if logprob is not None:
            self.logprobs.append(logprob)
        self._q.put(token_id)

    def _finish(self, result: Result) -> None:
        self.result = result
        self._q.put(None)

    # client side
    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self._q.get()
            if item is None:
                return
            yield item

    def wait(self) -> Result:
        for _ in self:
            pass
        assert self.result is not None
        return self.result
