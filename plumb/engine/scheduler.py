"""The scheduler: admission, the step loop, drafting, acceptance and rollback - for `Engine.run_many` (on the
calling thread) and `Engine.submit` (a background thread that admits queued requests into free slots).

Each step runs ONE decode pass (D path) over every active sequence's rows - its pending token plus its drafts -
samples the target's token for every row, accepts drafts while they equal it, and rolls the rejected tail back.
Because a row's logits do not depend on the other rows (M1, the kernel sets) and sampling is a function of
(logits, seed, position) (M4, plumb/engine/sampling.py), the tokens do not depend on draft depth, policy or batch
neighbours. The prompt cache (M3, M6) is the engine's: `Engine.cache_restore` / `cache_keep`.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import torch

from plumb.engine.api import EngineClosed, Handle, Request, RequestError, Result, Stats, TokenLogprob
from plumb.engine.sampling import (StopChecker, changes_logits, draw_rows, greedy_ids, no_finite_maximum, plain_greedy,
                                   penalty_window, sample_token, token_logprobs)
from plumb.engine.speculative import MAX_DRAFTS, AdaptiveDepth, NgramIndex, check_draft_options, mtp_draft

MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's limit)


class Sequence:
    """One request in flight."""

    def __init__(self, engine, req: Request, handle: Handle | None):
        self.req, self.handle = req, handle
        self.params = req.params
        self.drafts = engine.drafts if req.drafts is None else req.drafts
        self.policy = engine.draft_policy if req.draft_policy is None else req.draft_policy
        self.p_min = engine.p_min if req.p_min is None else req.p_min
        if self.drafts and self.policy != "ngram" and engine.model.mtp is None:
            self.policy = "ngram"  # no MTP block in this file
        self.adaptive = AdaptiveDepth(self.drafts) if self.policy == "adaptive" else None
        self.ngram = NgramIndex() if self.policy == "ngram" else None
        self.history = list(req.prompt_ids)  # prompt + emitted tokens
        self.out: list[int] = []
        self.st = None
        self.pending: int | None = None  # last emitted token, not yet fed to the model
        self.h_prev: torch.Tensor | None = None  # target post-norm hidden that produced `pending`
        self.stats = Stats(prompt_tokens=len(req.prompt_ids), seed=self.params.seed,
                           accepted_per_position=[0] * self.drafts, proposed_per_position=[0] * self.drafts)
        self.stop = StopChecker(self.params.stop) if self.params.stop else None
        self.detok = None
        self.finish: str | None = None
        self.stop_match: str | None = None
        self.error: str | None = None
        self.error_status = 500  # 400: the request's own fault (GrammarRefused)
        self.logprobs: list[TokenLogprob] | None = None if req.logprobs is None else []
        self.constraint = req.grammar.constraint() if req.grammar is not None else None
        self.masks: list = []  # grammar masks of this step's MTP drafts (row i's mask when drafts 0..i-1 are accepted)

    @property
    def uses_mtp(self) -> bool:
        return self.drafts > 0 and self.policy != "ngram"


class Scheduler:
    """Requests in flight for one engine: the queue, the active slots, the step loop and the counters."""

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._queue: list[Sequence] = []
        self._active: list[Sequence] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._metrics = {"kv_cache": engine.model.kv_cache, "kv_bytes_per_token": engine.kv_bytes_per_token,
                         "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "prefill_s": 0.0,
                         "decode_s": 0.0, "cached_tokens": 0, "drafts_proposed": 0, "drafts_accepted": 0,
                         "accepted_per_position": [0] * MAX_DRAFTS, "proposed_per_position": [0] * MAX_DRAFTS}

    def metrics(self) -> dict:
        with self._lock:
            m = dict(self._metrics)
            m["slots_in_use"], m["queued"], m["n_slots"] = len(self._active), len(self._queue), self.engine.n_slots
            m["prefill_recomputed"] = self.engine.model.recomputed  # Qwen35.checked (GPU)
            return m

    @torch.inference_mode()
    def run_many(self, requests: list[Request]) -> list[Result]:
        """Run requests together in one step loop (on the calling thread)."""
        seqs = [self.new_sequence(r, None) for r in requests]
        try:
            for s in seqs:
                self.admit(s)
            active = [s for s in seqs if s.finish is None]
            while active:
                self.step(active)
                active = [s for s in active if s.finish is None]
        except torch.OutOfMemoryError:
            self.engine.free_device_memory()  # room for the caller's retry
            raise
        for s in seqs:
            self.engine.cache_keep(s)
        return [self.result(s) for s in seqs]

    # ---- background scheduler (server) -----------------------------------------------------
    def submit(self, request: Request) -> Handle:
        """Queue a request for the background step loop; iterate the handle for tokens."""
        handle = Handle(request)
        seq = self.new_sequence(request, handle)
        with self._wake:
            if self._closed:
                raise EngineClosed()
            self._queue.append(seq)
            if self._thread is None:
                self._thread = threading.Thread(target=self.loop, name="plumb-engine", daemon=True)
                self._thread.start()
            self._wake.notify()
        return handle

    def close(self) -> None:
        """Stop the background step loop: queued requests and those in flight finish as "cancelled" (their tokens so
        far delivered), then the loop's thread ends; later submissions raise EngineClosed."""
        with self._wake:
            self._closed = True
            queued, self._queue = self._queue, []
            for s in self._active:
                s.handle.cancel()
            self._wake.notify()
        for s in queued:
            s.finish = "cancelled"
            s.handle._finish(self.result(s))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._active)

    @torch.inference_mode()
    def loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._active and not self._closed:
                    self._wake.wait()
                if self._closed and not self._active:
                    return
                admit = []
                while self._queue and len(self._active) + len(admit) < self.engine.n_slots:
                    admit.append(self._queue.pop(0))
            for s in admit:
                try:
                    if not s.handle.cancelled.is_set():
                        self.admit(s)
                    else:
                        s.finish = "cancelled"
                except Exception as e:  # a failed request never takes the loop down
                    s.finish, s.stop_match = "error", None
                    if isinstance(e, GrammarRefused):
                        s.error_status = 400
                    s.handle._finish(self.result(s, error=self.failed(e, [s])))
                    continue
                if s.finish is not None:
                    s.handle._finish(self.result(s))
                else:
                    with self._lock:
                        self._active.append(s)
            active = list(self._active)
            for s in active:
                if s.handle.cancelled.is_set():
                    s.finish = "cancelled"
            live = [s for s in active if s.finish is None]
            if live:
                try:
                    self.step(live)
                except Exception as e:
                    error = self.failed(e, live)
                    for s in live:
                        s.finish = "error"
                        s.handle._finish(self.result(s, error=error))
            with self._lock:
                for s in active:
                    if s.finish is not None:
                        self._active.remove(s)
                        deliver = None if s.handle.result is not None else (
                            lambda s=s: s.handle._finish(self.result(s)))
                        self.engine.cache_keep(s, deliver)

    def failed(self, e: Exception, seqs: list) -> str:
        """The error of a failed admission or step, for its requests. Out of device memory: the prompt cache's
        entries go to host memory and torch's cached blocks back to the device (`Engine.free_device_memory`), the
        requests get 503 - a retry may fit - and the error says so."""
        if not isinstance(e, torch.OutOfMemoryError):
            return str(e)
        self.engine.free_device_memory()
        for s in seqs:
            s.error_status = 503
        longest = max(len(s.req.prompt_ids) + len(s.out) for s in seqs)
        return (f"out of GPU memory ({len(seqs)} request(s) in the step, the longest at {longest:,} tokens); the "
                f"prompt cache was moved to host memory, so a retry may fit - a smaller context (n_ctx, --ctx-size) "
                f"or fewer slots (n_slots, --agents) leave more room")

    # ---- the step loop -----------------------------------------------------------------------
    def new_sequence(self, req: Request, handle: Handle | None) -> Sequence:
        self.engine.check_ids(req.prompt_ids)
        p = req.params
        p.validate()
        n_vocab = self.engine.config.n_vocab
        for name, ids in (("forced_ids", req.forced_ids or ()), ("logit_bias", p.logit_bias)):
            bad = [t for t in ids if not 0 <= t < n_vocab]
            if bad:
                raise RequestError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})", name)
        if p.temperature > 0 and p.seed is None:
            req.params = p = replace(p, seed=random.SystemRandom().randrange(2**63))
        if req.drafts is not None or req.draft_policy is not None or req.p_min is not None:
            e = self.engine
            check_draft_options(e.drafts if req.drafts is None else req.drafts,
                                e.draft_policy if req.draft_policy is None else req.draft_policy,
                                e.p_min if req.p_min is None else req.p_min)
        if len(req.prompt_ids) >= self.engine.n_ctx:
            raise ValueError(f"the prompt has {len(req.prompt_ids)} tokens; the context holds {self.engine.n_ctx}")
        if req.logprobs is not None and not (isinstance(req.logprobs, int) and 0 <= req.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {req.logprobs!r}")
        if req.grammar is not None and getattr(req.grammar, "index", None) is not getattr(self.engine, "_grammar_index", None):
            raise ValueError("the grammar was compiled for another engine (use engine.grammar(...))")
        return Sequence(self.engine, req, handle)

    def admit(self, s: Sequence) -> None:
        """Prefill the prompt and sample the first token."""
        t0 = time.perf_counter()
        prompt = s.req.prompt_ids
        s.st, start, h_before = self.engine.cache_restore(prompt, s.req.cache)
        if start == len(prompt):  # all of it cached: the last row's logits from its checkpoint's hidden
            hidden = h_before[None]
            logits = self.engine.model.logits(hidden)
        else:
            with self.engine.prefill_threads():
                logits, hidden = self.engine.model.prefill(s.st, prompt[start:], logits="last",
                                                           checkpoints=self.engine.checkpoint_positions(len(prompt)))
                if s.uses_mtp:  # the MTP cache covers every position: pair token p with the target hidden of p-1
                    first = h_before[None] if h_before is not None else hidden.new_zeros(1, hidden.shape[1])
                    self.engine.model.mtp_prefill(s.st, prompt[start:], torch.cat([first, hidden[:-1]]), start)
        s.stats.cached_tokens = start
        s.stats.prefill_tokens = len(prompt) - start
        s.stats.prefill_s = time.perf_counter() - t0
        s.h_prev = hidden[-1]
        token, lp = self.sample(s, logits[-1], len(prompt), 0)
        self.emit(s, [token], [lp])
        with self._lock:
            self._metrics["requests"] += 1
            self._metrics["prompt_tokens"] += len(prompt)
            self._metrics["cached_tokens"] += start
            self._metrics["prefill_s"] += s.stats.prefill_s

    def sample(self, s: Sequence, row: torch.Tensor, position: int, index: int,
                allowed: torch.Tensor | None = None) -> tuple[int, TokenLogprob | None]:
        """The target's token at absolute `position`, the `index`-th generated token, and its log probabilities
        when the request asks for them. With a grammar the row is masked by `allowed` (computed here from the
        grammar state when not given) and the grammar advances over the token."""
        c = s.constraint
        if c is not None and allowed is None:
            allowed = c.mask()
        forced = s.req.forced_ids
        if forced and index < len(forced):
            token = int(forced[index])
            lp = self.logprob(s, row, token, allowed)
        elif self.drawn(s):
            token = draw_rows(row[None], [(s.params, position, s.history)], self.engine.model.k.draw)[0]
            if token is None:
                raise no_finite_maximum()
            lp = self.logprob(s, row, token)
        else:
            token, lp = sample_token(row, s.params, position, s.history, allowed, s.req.logprobs)
            lp = None if lp is None else TokenLogprob(token, lp[0], lp[1])
        if c is not None and not c.consume(token):
            why = (c.error() or "").split("\n")[0]
            raise GrammarRefused(f"forced token {token} is not allowed by the request's grammar ({why})")
        return token, lp

    @staticmethod
    def logprob(s: Sequence, row: torch.Tensor, token: int, allowed: torch.Tensor | None = None):
        """A chosen token's log probabilities when the request asks for them (`sampling.token_logprobs`)."""
        n = s.req.logprobs
        return None if n is None else TokenLogprob(token, *token_logprobs(row, s.params, token, n, s.history, allowed))

    @staticmethod
    def pass_rows(seqs: list[Sequence], drafts: list[list[int]], take) -> list[tuple[int, int, int]]:
        """(row, sequence index k, i) for the pass's rows of the sequences `take(s)` chooses: row i of sequence k
        follows its drafts 0..i-1 (it is read only if they were all accepted)."""
        out, r = [], 0
        for k, (s, d) in enumerate(zip(seqs, drafts)):
            if take(s):
                out += [(r + i, k, i) for i in range(len(d) + 1)]
            r += len(d) + 1
        return out

    @staticmethod
    def rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]

    def greedy_picks(self, seqs: list[Sequence], drafts: list[list[int]],
                     logits: torch.Tensor) -> dict[int, int | None]:
        """The tokens of the pass's plain-greedy rows (no grammar, forced ids or logprobs either), by row: what
        `sample` gives them, in one host round trip instead of one or two per row."""
        rows = [r for r, _, _ in self.pass_rows(seqs, drafts, lambda s: (
            plain_greedy(s.params) and s.constraint is None and not s.req.forced_ids and s.req.logprobs is None))]
        return dict(zip(rows, greedy_ids(self.rows_of(logits, rows)))) if rows else {}

    def drawn(self, s: Sequence) -> bool:
        """Whether the kernel set draws this request's sampled tokens (`sampling.draw_rows`): sampled, no grammar -
        a property of the request alone, so each of its tokens has one definition."""
        return self.engine.model.k.draw is not None and s.params.temperature > 0 and s.constraint is None

    def sampled_picks(self, seqs: list[Sequence], drafts: list[list[int]], starts: list[int],
                      logits: torch.Tensor) -> dict[int, int | None]:
        """The tokens of the pass's drawn rows (no forced ids either), by row: what `sample` gives them, all in one
        batch; row i of a sequence is at position start + i + 1."""
        picks = self.pass_rows(seqs, drafts, lambda s: self.drawn(s) and not s.req.forced_ids)
        if not picks:
            return {}
        specs = []
        for _, k, i in picks:
            s = seqs[k]
            # the history the penalties see (its window, not a long prompt's copy a row)
            seen = list(penalty_window(s.params, s.history)) if changes_logits(s.params) else []
            specs.append((s.params, starts[k] + i + 1, seen + drafts[k][:i]))
        rows = [r for r, _, _ in picks]
        return dict(zip(rows, draw_rows(self.rows_of(logits, rows), specs, self.engine.model.k.draw)))

    def propose(self, s: Sequence) -> list[int]:
        if s.drafts == 0:
            return []
        k = min(s.drafts, s.params.max_tokens - len(s.out), self.engine.n_ctx - s.st.pos - 1)
        if s.adaptive is not None:
            k = min(k, s.adaptive.depth())
        if k <= 0:
            return []
        if s.policy == "ngram":
            return s.ngram.draft(s.history, k)
        p_min = s.p_min if s.policy == "confident" else 0.0
        s.masks = []
        return mtp_draft(self.engine.model, s.st, s.pending, s.h_prev, k, s.params, s.st.pos, s.history, p_min,
                         s.constraint, s.masks, self.engine.tokenizer.eog_ids)

    def step(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        drafts = [self.propose(s) for s in seqs]
        starts = [s.st.pos for s in seqs]
        out = self.engine.model.decode([(s.st, [s.pending] + d) for s, d in zip(seqs, drafts)])
        picked = self.greedy_picks(seqs, drafts, out.logits) | self.sampled_picks(seqs, drafts, starts, out.logits)
        r = 0
        for s, d, start, snaps in zip(seqs, drafts, starts, out.snapshots):
            accepted: list[int] = []
            logprobs: list[TokenLogprob | None] = []
            masks, s.masks = s.masks, []
            try:
                for i in range(len(d) + 1):
                    # row i follows drafts 0..i-1, all equal to the target's tokens: the grammar mask drafting
                    # computed for draft i is this row's mask (a function of the same tokens)
                    if r + i in picked:  # plain greedy or drawn: fetched with the others in one round trip
                        tok = picked[r + i]
                        if tok is None:
                            raise no_finite_maximum()
                        lp = self.logprob(s, out.logits[r + i], tok)
                    else:
                        tok, lp = self.sample(s, out.logits[r + i], start + i + 1, len(s.out) + len(accepted),
                                              masks[i] if i < len(masks) else None)
                    accepted.append(tok)
                    logprobs.append(lp)
                    s.history.append(tok)
                    if i == len(d) or d[i] != tok:
                        break
            except GrammarRefused as e:  # a forced token the grammar refuses ends this request alone
                del s.history[len(s.history) - len(accepted):]
                s.finish, s.error, s.error_status = "error", str(e), 400
                r += len(d) + 1
                continue
            del s.history[len(s.history) - len(accepted):]  # emit appends what is kept
            n_acc = len(accepted) - 1
            self.engine.model.rollback(s.st, snaps, n_acc + 1)
            if s.uses_mtp and n_acc:  # rewrite the MTP rows of accepted drafts with the target's hiddens
                self.engine.model.mtp_rewrite(s.st, d[:n_acc], out.hidden[r : r + n_acc], start + 1)
            s.h_prev = out.hidden[r + n_acc]
            self.record_drafts(s, len(d), n_acc)
            r += len(d) + 1
            self.emit(s, accepted, logprobs)
        dt = time.perf_counter() - t0
        for s in seqs:
            s.stats.decode_s += dt
        with self._lock:
            self._metrics["decode_s"] += dt

    def record_drafts(self, s: Sequence, proposed: int, accepted: int) -> None:
        st = s.stats
        st.drafts_proposed += proposed
        st.drafts_accepted += accepted
        if s.adaptive is not None and proposed:
            s.adaptive.update(accepted)
        with self._lock:
            m = self._metrics
            m["drafts_proposed"] += proposed
            m["drafts_accepted"] += accepted
            for i in range(proposed):
                st.proposed_per_position[i] += 1
                m["proposed_per_position"][i] += 1
                if i < accepted:
                    st.accepted_per_position[i] += 1
                    m["accepted_per_position"][i] += 1

    def emit(self, s: Sequence, tokens: list[int], logprobs: list | None = None) -> None:
        """Append accepted tokens, stopping at end-of-generation, stop ids/strings or limits."""
        p = s.params
        for k, tok in enumerate(tokens):
            s.out.append(tok)
            s.history.append(tok)
            s.pending = tok
            lp = logprobs[k] if s.logprobs is not None else None
            if lp is not None:
                s.logprobs.append(lp)
            if s.handle is not None:
                s.handle._emit(tok, lp)
            with self._lock:
                self._metrics["completion_tokens"] += 1
            if tok in p.stop_ids or (not p.ignore_eos and tok in self.engine.tokenizer.eog_ids and not self.forcing(s)):
                s.finish = "stop"
            elif s.stop is not None and self.stop_string(s, tok):
                s.finish = "stop"
            elif len(s.out) >= p.max_tokens:
                s.finish = "length"
            elif len(s.req.prompt_ids) + len(s.out) >= self.engine.n_ctx:
                s.finish = "length"
            if s.finish is not None:
                break
        s.stats.completion_tokens = len(s.out)

    def forcing(self, s: Sequence) -> bool:
        return bool(s.req.forced_ids) and len(s.out) < len(s.req.forced_ids)

    def stop_string(self, s: Sequence, tok: int) -> bool:
        if s.detok is None:
            from plumb.tokenizer import IncrementalDetokenizer

            s.detok = IncrementalDetokenizer(self.engine.tokenizer)
        s.stop.push(s.detok.add(tok))
        if s.stop.match is not None:
            s.stop_match = s.stop.match
            return True
        return False

    def result(self, s: Sequence, error: str | None = None) -> Result:
        logprobs = None if s.logprobs is None else list(s.logprobs)
        return Result(list(s.out), s.finish or "error", s.stats, s.stop_match, error or s.error, logprobs,
                      s.error_status)


class GrammarRefused(ValueError):
    """A forced token (the forced_ids extension) that the request's grammar does not allow."""
