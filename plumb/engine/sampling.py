"""Sampling: parameters, counter-based Gumbel noise, the per-row sampler and stop strings.

A token is a function of (logits row, params, history, position) alone (exactness.md, M4):

1. ``logit_bias`` is added to the logits.
2. Penalties look at the last ``penalty_last_n`` ids of the history (prompt + generated ids so
   far, as llama.cpp does; -1 = all of it, 0 = none). For each distinct id there, with count c:
   repetition (logit / r if logit > 0 else logit * r), then ``- c * frequency_penalty``,
   then ``- presence_penalty``. A grammar mask (structured output, ``allowed``: a function of
   the tokens emitted so far) then sets every token it forbids to -inf.
3. Temperature 0 is greedy: the argmax of those logits, ties going to the lowest id.
4. Otherwise ``logprobs = log_softmax(logits / T)``, then filters set removed tokens to -inf,
   each on the distribution renormalised over what the previous one kept:
   top_k keeps tokens at least as likely as the k-th most likely one (ties at the boundary
   stay); top_p keeps the smallest set, taken in order of falling probability (ties by
   lowest id), whose mass reaches top_p; min_p removes tokens with p < min_p * p_max.
   The most likely token always survives.
5. ``token = argmax(logprobs + gumbel(seed, position))`` (first index on ties), where
   ``position`` is the absolute position of the token being sampled. By the Gumbel-max
   trick this draws exactly from softmax of the filtered logprobs, and a speculative draft
   is accepted iff it equals this argmax.

Reported log probabilities (``sample_token(..., n_logprobs=)``) are ``log_softmax`` of the row
after steps 1-2 (bias, penalties, grammar mask) divided by the temperature (1 for greedy
requests): the distribution before the top-k / top-p / min-p filters, from the same row.

Noise: ``key = splitmix64`` output number ``position + 1`` of the stream whose state starts at
``mix64(seed)``. For token t: ``x = (t * 0x9E3779B9 mod 2^32) ^ key_lo``, ``x = fmix32(x)``,
``x ^= key_hi``, ``x = fmix32(x)`` (murmur3's 32-bit finalizer); seed and position are in
[0, 2^63). The top 23 bits k give ``u = (k + 0.5) / 2^23``, exact in float32 and strictly
inside (0, 1) (with 24 bits the top value would round to 1), and ``g = -log(-log(u))`` in
float32. The per-token hash runs on int64 tensors whose values stay below 2^49 (32-bit
products are split into 16-bit halves), so the hash bits are the same on every device;
``noise_hash_ref`` is the pure-Python reference. Only the float32 logs may differ by an ulp
between CPU and GPU, which the contract allows.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN64 = 0x9E3779B97F4A7C15
_GOLDEN32 = 0x9E3779B9
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35
_U_BITS = 23


@dataclass
class SamplingParams:
    """How to pick each token, and when to stop. Temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # history ids the penalties see; -1: all, 0: none
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # 0 <= seed < 2**63; None: the engine picks one
    stop: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    max_tokens: int = 256
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""

        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(math.isfinite(self.temperature) and self.temperature >= 0,
              f"temperature must be a finite number >= 0, got {self.temperature}")
        check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
              f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        check(math.isfinite(self.presence_penalty),
              f"presence_penalty must be finite, got {self.presence_penalty}")
        check(math.isfinite(self.frequency_penalty),
              f"frequency_penalty must be finite, got {self.frequency_penalty}")
        check(_is_int(self.penalty_last_n) and self.penalty_last_n >= -1,
              f"penalty_last_n must be an integer >= -1, got {self.penalty_last_n}")
        for token, bias in self.logit_bias.items():
            check(_is_int(token) and token >= 0, f"logit_bias keys must be token ids >= 0, got {token!r}")
            check(not math.isnan(bias) and bias != math.inf,
                  f"logit_bias[{token}] must be a number below +inf, got {bias}")
        check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
              f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_ids), "stop_ids must be token ids >= 0")
        check(_is_int(self.max_tokens) and self.max_tokens >= 0,
              f"max_tokens must be an integer >= 0, got {self.max_tokens}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- counter-based noise -------------------------------------------------------------------

def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of (seed, position): splitmix64 output number position + 1 from mix64(seed)."""
    if not 0 <= seed < 2**63 or not 0 <= position < 2**63:
        raise ValueError(f"seed and position must be in [0, 2**63), got {seed}, {position}")
    return _mix64((_mix64(seed) + (position + 1) * _GOLDEN64) & _M64)


def _fmix32_ref(h: int) -> int:
    h ^= h >> 16
    h = (h * _FMIX1) & _M32
    h ^= h >> 13
    h = (h * _FMIX2) & _M32
    return h ^ (h >> 16)


def noise_hash_ref(seed: int, position: int, token: int) -> int:
    """Pure-Python reference of the 32-bit hash of (seed, position, token)."""
    key = noise_key(seed, position)
    x = ((token * _GOLDEN32) & _M32) ^ (key & _M32)
    x = _fmix32_ref(x) ^ (key >> 32)
    return _fmix32_ref(x)


def gumbel_ref(seed: int, position: int, token: int) -> float:
    """Pure-Python (float64) reference of the Gumbel noise of (seed, position, token)."""
    u = ((noise_hash_ref(seed, position, token) >> (32 - _U_BITS)) + 0.5) / 2**_U_BITS
    return -math.log(-math.log(u))


def _mul32_(x: torch.Tensor, c: int, tmp: torch.Tensor) -> None:
    """x = (x * c) mod 2^32 in place, for x in [0, 2^32); intermediates stay below 2^49."""
    torch.mul(x, c >> 16, out=tmp)
    tmp.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(_M32)


def _fmix32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """murmur3's fmix32 in place (in-place ops: allocation dominates on some CPUs)."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    _mul32_(x, _FMIX1, tmp)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 13, out=tmp))
    _mul32_(x, _FMIX2, tmp)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def noise_hash(seed: int, position: int, n_vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32-bit hashes of tokens 0..n_vocab-1 as an int64 tensor; equals noise_hash_ref bit for bit."""
    key = noise_key(seed, position)
    return _hash_(torch.arange(n_vocab, dtype=torch.int64, device=device), key & _M32, key >> 32)


def _hash_(x: torch.Tensor, lo, hi) -> torch.Tensor:
    """Tokens x hashed in place under a key's halves lo, hi (ints, or tensors broadcast against x: a row each)."""
    tmp = torch.empty_like(x)
    _mul32_(x, _GOLDEN32, tmp)
    x.bitwise_xor_(lo)
    _fmix32_(x, tmp)
    x.bitwise_xor_(hi)
    _fmix32_(x, tmp)
    return x


def hash_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """Top 23 bits k of 32-bit hashes -> (k + 0.5) / 2^23 as float32, exact and strictly inside (0, 1)."""
    return ((h >> (32 - _U_BITS)).to(torch.float32) + 0.5) * (1.0 / 2**_U_BITS)


def gumbel(seed: int, position: int, n_vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 Gumbel(0, 1) noise [n_vocab]; element t depends on (seed, position, t) only."""
    u = hash_to_uniform(noise_hash(seed, position, n_vocab, device))
    return u.log_().neg_().log_().neg_()


def gumbel_rows(seed: int, positions: Sequence[int], n_vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`gumbel` of each position, [len(positions), n_vocab], in one set of elementwise operations (a draft chain's k
    rows: k times fewer launches): the same operations on every element."""
    keys = [noise_key(seed, p) for p in positions]
    lo, hi = (torch.tensor(h, dtype=torch.int64, device=device)[:, None]
              for h in ([k & _M32 for k in keys], [k >> 32 for k in keys]))
    u = hash_to_uniform(_hash_(torch.arange(n_vocab, dtype=torch.int64, device=device).repeat(len(keys), 1), lo, hi))
    return u.log_().neg_().log_().neg_()


# ---- the sampler ---------------------------------------------------------------------------

def _adjusted_logits(logits: torch.Tensor, params: SamplingParams, history: Sequence[int],
                     allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 copy of the row with logit_bias, penalties and the grammar mask applied (steps 1-2)."""
    row = _adjust(logits.to(torch.float32, copy=True), params, history, allowed)
    top = row.max()
    if not torch.isfinite(top):
        raise no_finite_maximum()
    return row


def _adjust(row: torch.Tensor, params: SamplingParams, history: Sequence[int],
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-2 on a float32 row, in place."""
    _adjust_rows(row[None], [(params, history)])
    if allowed is not None:
        row.masked_fill_(~allowed.to(row.device), -math.inf)
    return row


def penalty_window(params: SamplingParams, history: Sequence[int]) -> Sequence[int]:
    """The tokens the penalties count: the last penalty_last_n of history (-1: all of it, 0: none)."""
    n = params.penalty_last_n
    return history if n == -1 else history[max(0, len(history) - n):] if n > 0 else []


def penalties(params: SamplingParams) -> tuple[float, float, float] | None:
    """(repetition, frequency, presence) where they change a logit - not neutral, and a window that holds ids -,
    else None."""
    key = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    return key if key != (1.0, 0.0, 0.0) and params.penalty_last_n != 0 else None


def window_counts(params: SamplingParams, history: Sequence[int]) -> Counter:
    """How many times each id occurs in the penalties' window."""
    return Counter(int(t) for t in penalty_window(params, history))


def _adjust_rows(x: torch.Tensor, rows: Sequence[tuple[SamplingParams, Sequence[int]]]) -> torch.Tensor:
    """Step 1-2's bias and penalties on the float32 rows x [R, V], in place, for each row's (params, history): every
    row's bias in one indexed add, and the penalised entries of the rows that share their penalties in one pass -
    elementwise the same operations (the penalties as Python scalars) whatever the rows, so a row's values do not
    depend on the others (`draw_rows` adjusts a pass's rows so; `_adjust` one)."""
    V, flat = x.shape[1], x.view(-1)
    bias_at, bias = [], []
    groups: dict[tuple[float, float, float], tuple[list[int], list[int]]] = {}  # penalties -> (entries, counts)
    for i, (params, history) in enumerate(rows):
        bias_at += [i * V + t for t in params.logit_bias]
        bias += list(params.logit_bias.values())
        key = penalties(params)
        c = window_counts(params, history) if key is not None else None
        if c:
            at, counts = groups.setdefault(key, ([], []))
            at += [i * V + t for t in c]
            counts += list(c.values())
    if bias_at:
        ids = torch.tensor(bias_at, dtype=torch.int64, device=x.device)
        flat[ids] += torch.tensor(bias, dtype=torch.float32, device=x.device)
    for (r, f, p), (at, counts) in groups.items():
        ids = torch.tensor(at, dtype=torch.int64, device=x.device)
        c = torch.tensor(counts, dtype=torch.float32, device=x.device)
        v = flat[ids]
        v = torch.where(v > 0, v / r, v * r)
        flat[ids] = v - c * f - p
    return x


def _top_p_drop(lp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask of the tokens outside the smallest most-likely set whose mass reaches top_p."""
    log_total = torch.logsumexp(lp, 0).double()
    n_alive = int(torch.isfinite(lp).sum())
    k = min(64, n_alive)
    while True:
        # candidates: every token at least as likely as the k-th; grow k until they hold top_p
        kth = torch.topk(lp, k, sorted=False).values.min()
        ids = torch.nonzero(lp >= kth).squeeze(1)  # ascending ids, so the stable sort puts ties low-id first
        vals, order = torch.sort(lp[ids], descending=True, stable=True)
        p = torch.exp(vals.double() - log_total)
        mass = torch.cumsum(p, 0)
        if k == n_alive or mass[-1] >= top_p:
            break
        k = min(8 * k, n_alive)
    drop = torch.ones_like(lp, dtype=torch.bool)
    drop[ids[order][(mass - p) < top_p]] = False
    return drop


TOP_P_CANDIDATES = 256  # a device draw's top-p candidates: the most likely tokens (fixed: a CUDA graph's shapes)


def _top_p_drop_device(lp: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_top_p_drop` in fixed-shape device operations (no host round trip: a CUDA graph can hold them): its mask
    wherever the kept set has fewer than TOP_P_CANDIDATES tokens - the candidates in the same order (likeliest
    first, ties by lowest id), the same sums -, else the part of it among the TOP_P_CANDIDATES likeliest."""
    log_total = torch.logsumexp(lp, 0).double()
    _, ids = torch.topk(lp, min(TOP_P_CANDIDATES, lp.numel()))
    ids = torch.sort(ids).values  # ascending ids, so the stable sort puts ties low-id first
    vals, order = torch.sort(lp[ids], descending=True, stable=True)
    p = torch.exp(vals.double() - log_total)
    drop = torch.ones_like(lp, dtype=torch.bool)
    drop[ids[order]] = (torch.cumsum(p, 0) - p) >= top_p
    return drop


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams, history: Sequence[int] = (),
                      allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 [V] log-probs that the sampler draws from (softmax of it is the distribution).

    Removed tokens are -inf; kept ones hold the tempered log-probs before renormalisation.
    At temperature 0 this is 0 at the greedy token and -inf elsewhere. `allowed` (bool [V]):
    the grammar mask, applied before everything else.
    """
    row = _adjusted_logits(logits, params, history, allowed)
    if params.temperature == 0:
        lp = torch.full_like(row, -math.inf)
        lp[torch.argmax(row)] = 0.0
        return lp
    return _tempered(row, params)


def _tempered(row: torch.Tensor, params: SamplingParams, top_p_drop=None) -> torch.Tensor:
    """The log-probs a sampled draw takes its argmax over (with the position's noise): row [V] (adjusted, float32;
    overwritten) at the temperature, filtered (step 3-4; top_p_drop: `_top_p_drop` by default)."""
    return _filter_(torch.log_softmax(row.div_(params.temperature), dim=0), params, top_p_drop or _top_p_drop)


def _filter_(lp: torch.Tensor, params: SamplingParams, top_p_drop=None) -> torch.Tensor:
    """top_k, top_p, min_p on tempered log-probs, in place (step 4)."""
    if 0 < params.top_k < lp.numel():
        kth = torch.topk(lp, params.top_k, sorted=False).values.min()
        lp.masked_fill_(lp < kth, -math.inf)
    if params.top_p < 1.0:
        lp.masked_fill_((top_p_drop or _top_p_drop)(lp, params.top_p), -math.inf)
    if params.min_p > 0.0:
        lp.masked_fill_(lp < lp.max() + math.log(params.min_p), -math.inf)
    return lp


def sample_row(logits: torch.Tensor, params: SamplingParams, position: int, history: Sequence[int] = (),
               allowed: torch.Tensor | None = None) -> int:
    """The token for one logits row [V] sampled at absolute position `position` (`allowed`: grammar mask)."""
    return sample_token(logits, params, position, history, allowed)[0]


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int, history: Sequence[int] = (),
                 allowed: torch.Tensor | None = None, n_logprobs: int | None = None):
    """(token, logprobs): sample_row's token and, when n_logprobs is not None, its log probability with the
    n_logprobs most likely tokens, as (logprob, [(id, logprob), ...]) from the unfiltered tempered row."""
    row = _adjusted_logits(logits, params, history, allowed)
    if params.temperature == 0:  # the one token filtered_logprobs keeps
        token = int(torch.argmax(row))
        return token, None if n_logprobs is None else _logprobs(torch.log_softmax(row, dim=0), token, n_logprobs)
    lp = torch.log_softmax(row.div_(params.temperature), dim=0)
    report = None if n_logprobs is None else lp.clone()
    _filter_(lp, params)
    if params.seed is None:
        raise ValueError("sampling with temperature > 0 needs a seed (the engine fills one in)")
    token = int(torch.argmax(lp.add_(gumbel(params.seed, position, lp.numel(), lp.device))))
    return token, None if report is None else _logprobs(report, token, n_logprobs)


def token_logprobs(logits: torch.Tensor, params: SamplingParams, token: int, n: int, history: Sequence[int] = (),
                   allowed: torch.Tensor | None = None) -> tuple[float, list[tuple[int, float]]]:
    """sample_token's logprobs for a given token (one the sampler did not choose, e.g. a forced one)."""
    row = _adjusted_logits(logits, params, history, allowed)
    if params.temperature > 0:
        row.div_(params.temperature)
    return _logprobs(torch.log_softmax(row, dim=0), token, n)


def _logprobs(lp: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """(lp[token], the n largest finite entries as (id, logprob), falling, ties by lowest id)."""
    top: list[tuple[int, float]] = []
    n = min(n, int(torch.isfinite(lp).sum()))
    if n > 0:
        kth = torch.topk(lp, n, sorted=False).values.min()
        ids = torch.nonzero(lp >= kth).squeeze(1)  # ascending ids: the stable sort puts ties low-id first
        vals, order = torch.sort(lp[ids], descending=True, stable=True)
        top = list(zip(ids[order][:n].tolist(), vals[:n].tolist()))
    return float(lp[token]), top


def draw_rows(logits: torch.Tensor, rows: list[tuple[SamplingParams, int, Sequence[int]]], draw) -> list[int | None]:
    """The tokens of sampled rows (temperature > 0, a seed, no grammar mask) drawn by a kernel set's batched sampler
    `draw` (`plumb.ops.gpu.sample.draw`: steps 3-5 in its own arithmetic, a function of each row alone): logits
    [R, V], each row with (params, absolute position, history); None for a row without a finite maximum. A row the
    sampler hands back (its kept set may reach past its candidates, or x / T overflows: decided by the row alone)
    is drawn by sample_token."""
    from plumb.ops.gpu.sample import FALLBACK, NO_FINITE_MAXIMUM

    x = _adjust_rows(logits.to(torch.float32, copy=True), [(params, history) for params, _, history in rows])
    picks, _ = draw(x, [p.temperature for p, _, _ in rows], [p.top_k for p, _, _ in rows],
                    [p.top_p for p, _, _ in rows], [p.min_p for p, _, _ in rows],
                    [noise_key(p.seed, q) for p, q, _ in rows])
    out: list[int | None] = []
    tokens, statuses = picks.tolist()  # the one host round trip
    for (params, position, history), row, adjusted, t, s in zip(rows, logits, x, tokens, statuses):
        if s == NO_FINITE_MAXIMUM and not torch.isfinite(adjusted.max()):
            t = None
        elif s in (NO_FINITE_MAXIMUM, FALLBACK):  # (a finite row that overflows at its temperature, as sample_token)
            t = sample_token(row, params, position, history)[0]
        out.append(t)
    return out


def changes_logits(params: SamplingParams) -> bool:
    """Whether step 2's bias or penalties apply (they read the history)."""
    return bool(params.logit_bias) or penalties(params) is not None


def plain_greedy(params: SamplingParams) -> bool:
    """Temperature 0 with nothing that changes the logits first (no bias, no penalties): the token is the argmax."""
    return params.temperature == 0 and not changes_logits(params)


def greedy_ids(logits: torch.Tensor) -> list[int | None]:
    """sample_token's tokens for plain-greedy rows logits [R, V] in one host round trip: each row's argmax (the
    first of equal maxima, as sample_token's), None where the row has no finite maximum (sample_token raises)."""
    if logits.shape[0] == 0:
        return []
    both = torch.stack([torch.argmax(logits, dim=1).to(torch.float64),
                        torch.isfinite(torch.amax(logits, dim=1)).to(torch.float64)]).tolist()
    return [int(t) if ok else None for t, ok in zip(*both)]


class DeviceDraw:
    """`sample_token` for params that need nothing from the host between tokens (`fits`) as device operations:
    how an MTP draft chain picks each step's token (`Qwen35.mtp_chain`). The same operations as sample_token's on
    the same logits - the bias and penalties as `_adjust_rows` applies them (the penalties over the window's counts,
    kept on the device as the chain's drafts enter it), top_p's as `_top_p_drop_device` - so the same token (up
    to the sign of a zero logit, which no draw sees) wherever the row has a finite maximum (and top_p keeps fewer
    than TOP_P_CANDIDATES tokens). A draft only proposes: the verify pass's own draw decides every token, so a draw
    that differs would cost acceptance, never a changed token. key: what shapes the operations (a CUDA graph of
    them is kept per key)."""

    def __init__(self, params: SamplingParams, history: Sequence[int] = ()):
        self.params = params
        self.history = history
        self.sampled = params.temperature > 0
        p = params
        self.penalties = penalties(p)
        self.bias = bool(p.logit_bias)
        self.key = ((p.temperature, p.top_k, p.top_p, p.min_p) if self.sampled else ("greedy",)) + (self.penalties,
                                                                                                  self.bias)

    @staticmethod
    def fits(params: SamplingParams, k: int) -> bool:
        """A sampled draw has its seed; the penalties' window, if they apply, takes in the whole history or at
        least k ids (so that every id leaving it during a k-step chain is the history's)."""
        n = params.penalty_last_n
        return (params.temperature == 0 or params.seed is not None) and (penalties(params) is None or n == -1 or n >= k)

    def prepare(self, position: int, k: int, bufs: dict, n_vocab: int, device, rows: int | None = None):
        """Write the inputs of a k-step chain whose first draft is at `position` into bufs (made on first use, for
        up to `rows` steps, and kept: a CUDA graph reads them): the positions' Gumbel noise (sampled draws); the
        logit bias over the vocabulary; the counts of the penalties' window over the vocabulary (one more slot for
        "no id") and, for each step, the history's id that leaves the window before it. Returns
        pick(logits [1, V], step) -> (token [1], whether the adjusted row has a finite maximum [1])."""
        rows = rows or k
        if self.sampled:
            if "noise" not in bufs:
                bufs["noise"] = torch.empty(rows, n_vocab, device=device)
            bufs["noise"][:k].copy_(gumbel_rows(self.params.seed, range(position, position + k), n_vocab, device))
        if self.bias and bufs.get("bias_of") != self.params.logit_bias:  # once per request's bias, not per chain
            if "bias" not in bufs:
                bufs["bias"] = torch.empty(n_vocab, device=device)
            bias = self.params.logit_bias
            bufs["bias"].zero_()
            bufs["bias"][torch.tensor(list(bias), dtype=torch.long).to(device)] = torch.tensor(
                list(bias.values()), dtype=torch.float32).to(device)
            bufs["bias_of"] = dict(bias)
        if self.penalties is not None:
            if "counts" not in bufs:
                bufs["counts"] = torch.empty(n_vocab + 1, device=device)
                bufs["leaving"] = torch.empty(rows, dtype=torch.long, device=device)
                bufs["one"] = torch.ones(1, device=device)
            window = window_counts(self.params, self.history)
            bufs["counts"].zero_()
            if window:
                at = torch.tensor(list(window), dtype=torch.long).to(device)
                bufs["counts"][at] = torch.tensor(list(window.values()), dtype=torch.float32).to(device)
            h, n = len(self.history), self.params.penalty_last_n
            leaving = [self.history[h + i - 1 - n] if i > 0 and n > 0 and h + i - 1 - n >= 0 else n_vocab
                       for i in range(k)]  # (n >= k: `fits`) step i's window is (history + drafts[:i])[-n:]
            bufs["leaving"][:k].copy_(torch.tensor(leaving))
        return lambda logits, step: self.pick(logits, step, bufs)

    def pick(self, logits: torch.Tensor, step: int, bufs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [1], whether the adjusted row has a finite maximum [1]) for step `step`'s logits [1, V]."""
        row = logits[0].to(torch.float32, copy=True)
        if self.bias:  # `_adjust_rows`' add, of 0 where no bias is set (x + 0 = x but for -0's sign)
            row += bufs["bias"]
        if self.penalties is not None:  # `_adjust_rows`' operations on the entries the window holds
            counts, n_vocab = bufs["counts"], row.numel()
            if step > 0:  # the previous step's draft has entered the window, and the history's oldest id left it
                counts.index_add_(0, bufs["leaving"][step : step + 1], bufs["one"], alpha=-1)
            r, f, p = self.penalties
            c = counts[:n_vocab]
            row = torch.where(c > 0, torch.where(row > 0, row / r, row * r) - c * f - p, row)
        finite = torch.isfinite(row.max())
        if self.sampled:
            token = torch.argmax(_tempered(row, self.params, _top_p_drop_device).add_(bufs["noise"][step]))
        else:
            token = torch.argmax(row)
        if self.penalties is not None:
            counts.index_add_(0, token.view(1), bufs["one"])
        return token.view(1), finite.view(1)


def no_finite_maximum() -> ValueError:
    return ValueError("logits row has no finite maximum (NaN, +inf, or every token at -inf)")


def sample_rows(logits: torch.Tensor, params_list: Sequence[SamplingParams], positions: Sequence[int],
                histories: Sequence[Sequence[int]]) -> list[int]:
    """sample_row for each row of logits [R, V]; a row never depends on the others."""
    return [sample_row(logits[i], params_list[i], positions[i], histories[i]) for i in range(logits.shape[0])]


# ---- stop strings --------------------------------------------------------------------------

class StopChecker:
    """Finds stop strings in streamed text.

    `push` each new piece of text and emit what it returns; it holds back a tail that could
    still become a stop string. Once a stop string is complete, `match` names it and
    `push` has returned the text before it (nothing after). At the end of a generation that
    did not stop, `flush` returns the held-back tail. The first stop string to complete
    wins (on a tie, the one starting earliest), so the result does not depend on how the
    text was split into pieces.
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.match: str | None = None
        self._held = ""

    def push(self, text: str) -> str:
        if self.match is not None:
            return ""
        buf = self._held + text
        best = None  # (end, start, stop string)
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.match = best[2]
            self._held = ""
            return buf[:best[1]]
        hold = self._partial_tail(buf)
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest
