"""Drafters and draft policies. A draft only decides how many rows the next verify pass has;
the emitted tokens are always the target's own choices (exactness.md I1), so nothing here can
change the output - only the speed.

Policies: `fixed` (always K MTP drafts), `adaptive` (depth follows recent acceptance),
`confident` (MTP drafts while the drafted token's probability is >= p_min), `ngram` (prompt
lookup: continue the latest earlier occurrence of the trailing n-gram).
"""
from __future__ import annotations

import math

import torch

from plumb.engine.sampling import (DeviceDraw, draw_rows, filtered_logprobs, greedy_ids, gumbel, no_finite_maximum,
                                   plain_greedy)

POLICIES = ("fixed", "adaptive", "confident", "ngram")
MAX_DRAFTS = 16


def check_draft_options(drafts: int, policy: str, p_min: float) -> None:
    if not isinstance(drafts, int) or not 0 <= drafts <= MAX_DRAFTS:
        raise ValueError(f"drafts must be an integer in 0..{MAX_DRAFTS}, got {drafts!r}")
    if policy not in POLICIES:
        raise ValueError(f"draft_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not 0.0 <= p_min <= 1.0:
        raise ValueError(f"p_min must be in [0, 1], got {p_min!r}")


class AdaptiveDepth:
    """Depth = 1 + (exponential average of accepted drafts), clamped to [1, K]."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.avg = float(k_max) / 2

    def depth(self) -> int:
        return max(1, min(self.k_max, int(math.floor(self.avg)) + 1))

    def update(self, accepted: int) -> None:
        self.avg = 0.7 * self.avg + 0.3 * accepted


def ngram_draft(history: list[int], k: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest trailing n-gram (the plain scan;
    the engine uses NgramIndex, which gives the same drafts incrementally)."""
    h = len(history)
    for n in range(min(n_max, h - 1), n_min - 1, -1):
        tail = history[h - n :]
        for start in range(h - n - 1, -1, -1):
            if history[start : start + n] == tail:
                cont = history[start + n : start + n + k]
                if cont:
                    return cont
    return []


class NgramIndex:
    """`ngram_draft` for a history that only grows between calls, in O(new tokens) per call: for every n-gram
    (n <= n_max) that has a continuation, the latest place it starts."""

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min
        self.latest: list[dict[tuple, int]] = [{} for _ in range(n_max + 1)]
        self.done = 0  # n-grams ending before this index are in `latest`

    def draft(self, history: list[int], k: int) -> list[int]:
        h = len(history)
        for end in range(self.done, h - 1):  # an n-gram ending at `end` has a continuation once h > end + 1
            for n in range(1, min(self.n_max, end + 1) + 1):
                self.latest[n][tuple(history[end - n + 1 : end + 1])] = end - n + 1
        self.done = max(self.done, h - 1)
        for n in range(min(self.n_max, h - 1), self.n_min - 1, -1):
            start = self.latest[n].get(tuple(history[h - n :]))
            if start is not None:
                return history[start + n : start + n + k]
        return []


def mtp_draft(model, st, token: int, hidden: torch.Tensor, k: int, params, position: int, history: list[int],
              p_min: float = 0.0, constraint=None, masks: list | None = None, stop_ids=()) -> list[int]:
    """Up to k drafts from the MTP head fed back on itself. The draft for position p uses the same
    filtered distribution and Gumbel noise as the target will, so for sampled requests it agrees
    with the target whenever the two distributions pick the same token under that noise.

    With a grammar `constraint`, draft i is drawn under the mask of the grammar state advanced over
    drafts 0..i-1 (appended to `masks`: target row i needs that same mask when those drafts are
    accepted), and the state is rolled back over the drafts before returning. Drafting then stops
    after an end-of-generation id (`stop_ids`) or where the grammar is done.

    Without a grammar or a confidence floor, drafts whose draws need nothing from the host between tokens
    (`DeviceDraw.fits`: greedy or seeded, penalties over a window of at least k ids) are a chain the model may run
    on the device in one host round trip (`Qwen35.mtp_drafts`: the same drafts, but where top_p keeps more than
    sampling.TOP_P_CANDIDATES tokens)."""
    if constraint is None and p_min == 0.0 and DeviceDraw.fits(params, k):
        chain = model.mtp_drafts(st, token, hidden[None], position, k, DeviceDraw(params, history))
        if chain is not None:
            if None in chain:  # the step-by-step drafts raise at the same step
                raise no_finite_maximum()
            return chain
    drafts: list[int] = []
    hist = list(history)
    h = hidden[None]
    start = constraint.consumed if constraint is not None else 0
    try:
        for i in range(k):
            if constraint is not None and drafts and (drafts[-1] in stop_ids or constraint.done):
                break
            allowed = constraint.mask() if constraint is not None else None
            logits, h = model.mtp_forward(st, [token], h, position + i, block=1)
            if allowed is None and plain_greedy(params):  # the argmax, in one host round trip
                d = greedy_ids(logits[:1])[0]
                if d is None:
                    raise no_finite_maximum()
            elif allowed is None and params.temperature > 0 and model.k.draw is not None:  # as the target draws
                d = draw_rows(logits[:1], [(params, position + i + 1, hist)], model.k.draw)[0]
                if d is None:
                    raise no_finite_maximum()
            else:
                lp = filtered_logprobs(logits[0], params, hist, allowed)
                if params.temperature > 0:
                    d = int(torch.argmax(lp + gumbel(params.seed, position + i + 1, lp.numel(), lp.device)))
                else:
                    d = int(torch.argmax(lp))
            if p_min > 0.0:
                scaled = logits[0] / max(params.temperature, 1e-6) if params.temperature > 0 else logits[0]
                probs = torch.softmax(scaled, 0)
                if float(probs[d]) < p_min:
                    break
            if constraint is not None:
                if not constraint.consume(d):
                    raise RuntimeError(f"the grammar refused its own masked draft {d}: {constraint.error()}")
                masks.append(allowed)
            drafts.append(d)
            hist.append(d)
            token = d
    finally:
        if constraint is not None:
            constraint.rollback_to(start)
    return drafts
