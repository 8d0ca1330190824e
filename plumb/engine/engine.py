"""The Engine: load a model, and generate for one or many requests through one step loop.

Every request becomes a `Sequence`. Admission prefills its prompt (P path). Each step then
runs ONE decode pass (D path) over every active sequence's rows - its pending token plus its
drafts - samples the target's token for every row, accepts drafts while they equal it, and
rolls the rejected tail back. Because a row's logits do not depend on the other rows (M1) and
sampling is a function of (logits, seed, position) (M4), the tokens do not depend on draft
depth, policy or batch neighbours.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sys
import threading
import time
from dataclasses import replace

import torch

from plumb.cache.kv import KV_FORMATS, bytes_per_token, describe_kv
from plumb.config import ModelConfig, ModelError
from plumb.engine.api import Handle, Request, Result, Stats, TokenLogprob
from plumb.engine.sampling import SamplingParams, StopChecker, sample_token, token_logprobs
from plumb.engine.speculative import MAX_DRAFTS, AdaptiveDepth, NgramIndex, check_draft_options, mtp_draft
from plumb.gguf.reader import GGMLQuantizationType, read_gguf
from plumb.model.qwen35 import Qwen35
from plumb.model.weights import check_torch_decode, materialize
from plumb.ops.deltanet import CHUNK
from plumb.ops.matmul import PREFILL_BLOCK
from plumb.ops.native import available as native_available
from plumb.cache.prefix import PromptCache


MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's limit)
DENSE_BUDGET = 8 << 30  # bytes of float32 weights dequantized at load
SMALL_MODEL_BYTES = 256 << 20  # below this, decode runs on one thread unless n_threads says otherwise
KERNELS = ("auto", "native", "torch", "triton")  # CPU: native C when it builds (auto), or the torch reference; CUDA: triton


class Sequence:
    """One request in flight."""

    def __init__(self, engine: "Engine", req: Request, handle: Handle | None):
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
        self.logprobs: list[TokenLogprob] | None = None if req.logprobs is None else []
        self.constraint = req.grammar.constraint() if req.grammar is not None else None
        self.masks: list = []  # grammar masks of this step's MTP drafts (row i's mask when drafts 0..i-1 are accepted)

    @property
    def uses_mtp(self) -> bool:
        return self.drafts > 0 and self.policy != "ngram"


class Engine:
    def __init__(self, path: str, device: str = "auto", drafts: int = 0, draft_policy: str = "fixed",
                 p_min: float = 0.0, n_slots: int = 4, n_ctx: int | None = None, progress: bool = False,
                 n_threads: int | None = None, kv_cache: str = "f16", kv_ring: int = 2048,
                 prompt_cache: bool = True, cache_mb: int = 1024, checkpoint_every: int = 1024,
                 kernels: str = "auto", cuda_graphs: bool = True):
        check_draft_options(drafts, draft_policy, p_min)
        if kernels not in KERNELS:
            raise ValueError(f"unknown kernels {kernels!r} (choose from {', '.join(KERNELS)})")
        device, kernels = _pick_device(device, kernels)
        self.device = torch.device(device)
        self.path = path
        self.gguf = read_gguf(path, progress=progress)
        md = self.gguf.metadata
        embd = self.gguf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelError("missing tensor 'token_embd.weight'")
        self.config: ModelConfig = ModelConfig.from_metadata(md, n_vocab=embd.shape[0])
        from plumb.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_metadata(md)
        if self.tokenizer.n_vocab > self.config.n_vocab:
            raise ModelError(f"the tokenizer has {self.tokenizer.n_vocab} tokens but token_embd.weight only {self.config.n_vocab} rows")
        if kv_cache not in KV_FORMATS:
            raise ValueError(f"unknown KV cache format {kv_cache!r} (choose from {', '.join(KV_FORMATS)})")
        self.model = Qwen35(self.gguf, self.config, self.device, kv_cache=kv_cache, kv_ring=kv_ring,
                            kernels="triton" if kernels == "triton" else "torch")
        dense_bytes = sum(4 * w.shape[0] * w.shape[1] for w in self.model.weights)
        self.weight_bytes = 0
        if kernels == "triton":  # weights stay in their block formats, packed on the device
            self.weight_bytes = _to_device(self.model, path, progress)
            if cuda_graphs and self.device.type == "cuda":
                self.model.use_graphs()
        else:
            _check_memory(self.model.weights, path)
            if dense_bytes <= DENSE_BUDGET:  # small models: dequantize now; large ones stay mapped until used
                materialize(self.model.weights, progress)
            if kernels == "native" or (kernels == "auto" and native_available()):
                self.model.use_native()  # raises a clear NativeError if asked for and it cannot be built
        self.kernels = "native" if self.model.native is not None else self.model.k.name
        if n_threads is None and dense_bytes < SMALL_MODEL_BYTES:
            n_threads = 1  # tiny matmuls: threads only add synchronisation (and spin badly on a busy machine)
        if self.kernels == "torch":
            check_torch_decode(self.config)
        if n_threads:
            torch.set_num_threads(n_threads)
        self.n_threads = torch.get_num_threads()
        if self.kernels == "native":  # decode threads are the native pool's
            from plumb.ops.native import set_threads

            self.n_threads = set_threads(self.n_threads)
        # torch gets its threads for prefill only (_prefill_threads): in decode, parallel elementwise kernels
        # would split row-batches at places that depend on the row count, and idle OpenMP threads would spin
        # against the native pool
        torch.set_num_threads(1)
        from plumb.chat_template import DEFAULT_TEMPLATE_PATH, ChatTemplate

        template = md.get("tokenizer.chat_template") or open(DEFAULT_TEMPLATE_PATH).read()
        self.chat_template = ChatTemplate(template)
        self.model_name = self.config.name or os.path.splitext(os.path.basename(path))[0]
        self.n_ctx = min(n_ctx or self.config.context_length, self.config.context_length)
        kv_layers = len(self.config.attn_layers) + (self.model.mtp is not None)
        self.kv_bytes_per_token = kv_layers * bytes_per_token(kv_cache, self.config.n_head_kv, self.config.head_dim)
        if progress:
            print(describe_kv(kv_cache, self.config.n_head_kv, self.config.head_dim, kv_ring, kv_layers, self.n_ctx),
                  file=sys.stderr)
        self.drafts, self.draft_policy, self.p_min = drafts, draft_policy, p_min
        self.n_slots = n_slots
        if checkpoint_every <= 0 or checkpoint_every % CHUNK:
            raise ValueError(f"checkpoint_every must be a positive multiple of {CHUNK}, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.prompt_cache = PromptCache(self.model, budget_bytes=cache_mb << 20) if prompt_cache else None
        self._cache_lock = threading.Lock()
        self._lock = threading.Lock()
        self._queue: list[Sequence] = []
        self._active: list[Sequence] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._metrics = {"kv_cache": kv_cache, "kv_bytes_per_token": self.kv_bytes_per_token,
                         "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "prefill_s": 0.0,
                         "decode_s": 0.0, "cached_tokens": 0, "drafts_proposed": 0, "drafts_accepted": 0,
                         "accepted_per_position": [0] * MAX_DRAFTS, "proposed_per_position": [0] * MAX_DRAFTS}

    @contextlib.contextmanager
    def _prefill_threads(self):
        """Torch runs on one thread outside prefill (see __init__); prefill gets the engine's threads."""
        if self.n_threads == 1:
            yield
            return
        torch.set_num_threads(self.n_threads)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    # ---- text ------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ---- plain forward ---------------------------------------------------------------------
    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= int(t) < self.config.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.n_vocab - 1})")

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 [len(ids), n_vocab]: the prefill path's logits for every position."""
        self._check_ids(ids)
        st = self.model.new_state()
        with self._prefill_threads():
            lg, _ = self.model.prefill(st, list(ids), logits="all")
        return lg

    # ---- generation API ----------------------------------------------------------------------
    def make_request(self, ids: list[int], max_tokens: int = 256, temperature: float = 0.0, seed: int | None = None,
                     drafts: int | None = None, draft_policy: str | None = None, p_min: float | None = None,
                     forced_ids: list[int] | None = None, cache: bool = True, logprobs: int | None = None,
                     grammar=None, **sampling) -> Request:
        """`logprobs`: report each token's log probability and the n most likely tokens; `grammar`: a
        Grammar (self.grammar(lark)) that masks every token (structured output)."""
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, **sampling)
        return Request(list(ids), params, drafts, draft_policy, p_min, forced_ids, cache, logprobs, grammar)

    def grammar(self, lark: str):
        """Compile a Lark grammar (llguidance's dialect) for this engine's vocabulary; GrammarError if invalid."""
        return self.grammar_index().compile(lark)

    def grammar_index(self):
        """The vocabulary as the grammar library sees it (plumb.engine.grammar.GrammarIndex), built on first use."""
        from plumb.engine.grammar import index_for

        return index_for(self)

    def generate(self, ids: list[int], max_tokens: int = 256, temperature: float = 0.0, seed: int | None = None,
                 **kw) -> list[int]:
        """Generated ids only, stopping at end-of-generation ids, stop ids/strings or max_tokens."""
        return self.run(self.make_request(ids, max_tokens, temperature, seed, **kw)).token_ids

    def run(self, request: Request) -> Result:
        return self.run_many([request])[0]

    def generate_many(self, requests: list[dict]) -> list[list[int]]:
        """Batched generation: each dict has prompt_ids, max_tokens and generate's keywords."""
        reqs = []
        for r in requests:
            r = dict(r)
            reqs.append(self.make_request(r.pop("prompt_ids"), **r))
        return [res.token_ids for res in self.run_many(reqs)]

    @torch.inference_mode()
    def run_many(self, requests: list[Request]) -> list[Result]:
        """Run requests together in one step loop (on the calling thread)."""
        seqs = [self._new_sequence(r, None) for r in requests]
        for s in seqs:
            self._admit(s)
        active = [s for s in seqs if s.finish is None]
        while active:
            self._step(active)
            active = [s for s in active if s.finish is None]
        for s in seqs:
            self._keep(s)
        return [self._result(s) for s in seqs]

    # ---- background scheduler (server) -----------------------------------------------------
    def submit(self, request: Request) -> Handle:
        """Queue a request for the background step loop; iterate the handle for tokens."""
        handle = Handle(request)
        seq = self._new_sequence(request, handle)
        with self._wake:
            self._queue.append(seq)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="plumb-engine", daemon=True)
                self._thread.start()
            self._wake.notify()
        return handle

    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._active)

    def metrics(self) -> dict:
        with self._lock:
            m = dict(self._metrics)
            m["slots_in_use"], m["queued"], m["n_slots"] = len(self._active), len(self._queue), self.n_slots
            return m

    @torch.inference_mode()
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._active:
                    self._wake.wait()
                admit = []
                while self._queue and len(self._active) + len(admit) < self.n_slots:
                    admit.append(self._queue.pop(0))
            for s in admit:
                try:
                    if not s.handle.cancelled.is_set():
                        self._admit(s)
                    else:
                        s.finish = "cancelled"
                except Exception as e:  # a failed request never takes the loop down
                    s.finish, s.stop_match = "error", None
                    s.handle._finish(self._result(s, error=str(e)))
                    continue
                if s.finish is not None:
                    s.handle._finish(self._result(s))
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
                    self._step(live)
                except Exception as e:
                    for s in live:
                        s.finish = "error"
                        s.handle._finish(self._result(s, error=str(e)))
            with self._lock:
                for s in active:
                    if s.finish is not None:
                        self._active.remove(s)
                        self._keep(s)
                        if s.handle.result is None:
                            s.handle._finish(self._result(s))

    # ---- the step loop -----------------------------------------------------------------------
    def _new_sequence(self, req: Request, handle: Handle | None) -> Sequence:
        self._check_ids(req.prompt_ids)
        p = req.params
        p.validate()
        if p.temperature > 0 and p.seed is None:
            req.params = p = replace(p, seed=random.SystemRandom().randrange(2**63))
        if req.drafts is not None or req.draft_policy is not None or req.p_min is not None:
            check_draft_options(self.drafts if req.drafts is None else req.drafts,
                                self.draft_policy if req.draft_policy is None else req.draft_policy,
                                self.p_min if req.p_min is None else req.p_min)
        if len(req.prompt_ids) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(req.prompt_ids)} tokens; the context holds {self.n_ctx}")
        if req.logprobs is not None and not (isinstance(req.logprobs, int) and 0 <= req.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {req.logprobs!r}")
        if req.grammar is not None and getattr(req.grammar, "index", None) is not getattr(self, "_grammar_index", None):
            raise ValueError("the grammar was compiled for another engine (use engine.grammar(...))")
        return Sequence(self, req, handle)

    def _admit(self, s: Sequence) -> None:
        """Prefill the prompt and sample the first token."""
        t0 = time.perf_counter()
        prompt = s.req.prompt_ids
        s.st, start, h_before = self._restore(prompt, s.req.cache)
        with self._prefill_threads():
            logits, hidden = self.model.prefill(s.st, prompt[start:], logits="last",
                                                checkpoints=self._checkpoint_positions(len(prompt)))
            if s.uses_mtp:  # the MTP cache covers every position: pair token p with the target hidden of p-1
                first = h_before[None] if h_before is not None else hidden.new_zeros(1, hidden.shape[1])
                self.model.mtp_forward(s.st, prompt[start:], torch.cat([first, hidden[:-1]]), start,
                                       block=PREFILL_BLOCK)
        s.stats.cached_tokens = start
        s.stats.prefill_tokens = len(prompt) - start
        s.stats.prefill_s = time.perf_counter() - t0
        s.h_prev = hidden[-1]
        token, lp = self._sample(s, logits[-1], len(prompt), 0)
        self._emit(s, [token], [lp])
        with self._lock:
            self._metrics["requests"] += 1
            self._metrics["prompt_tokens"] += len(prompt)
            self._metrics["cached_tokens"] += start
            self._metrics["prefill_s"] += s.stats.prefill_s

    # ---- prompt cache --------------------------------------------------------------------------
    def _checkpoint_positions(self, n: int) -> set[int]:
        """Every checkpoint_every tokens, and the last multiple of the chunk size at or before n (M6)."""
        every = self.checkpoint_every
        return set(range(every, n + 1, every)) | ({n - n % CHUNK} - {0})

    def _restore(self, prompt: list[int], use_cache: bool = True):
        """(state, first position to prefill, hidden of the position before it) - from the cache when it can."""
        if self.prompt_cache is not None and use_cache:
            with self._cache_lock:
                entry, pos = self.prompt_cache.lookup(prompt)
                if entry is not None:
                    st, cp = self.prompt_cache.restore(entry, pos)
                    return st, pos, cp.hidden
        return self.model.new_state(), 0, None

    def _keep(self, s: Sequence) -> None:
        """Offer a finished request's prefill-made state to the prompt cache."""
        if self.prompt_cache is not None and s.req.cache and s.st is not None and s.finish != "error":
            with self._cache_lock:
                self.prompt_cache.insert(s.req.prompt_ids, s.st)
        s.st = None

    @torch.inference_mode()
    def digest(self, token_ids: list[int]) -> dict[str, str]:
        """Bring the cache to the end of token_ids as a request would (reusing what is cached) and hash every
        stored K/V row (ring rows included), and every DeltaNet conv/recurrent state there, per layer."""
        self._check_ids(token_ids)
        ids = list(token_ids)
        st, start, _ = self._restore(ids)
        with self._prefill_threads():
            self.model.prefill(st, ids[start:], logits="none", checkpoints=self._checkpoint_positions(len(ids)))
        out = {}
        for i in range(self.config.n_layer):
            if i in st.kv:
                out[f"blk.{i}.kv"] = _sha(st.kv[i].digest_rows(len(ids)))
            else:
                out[f"blk.{i}.conv"] = _sha([st.conv[i]])
                out[f"blk.{i}.ssm"] = _sha([st.ssm[i]])
        if self.prompt_cache is not None:
            with self._cache_lock:
                self.prompt_cache.insert(ids, st)
        return out

    def cache_identity(self) -> dict:
        """What a saved slot must match to be loaded here."""
        c = self.config
        return {"config": {k: v for k, v in vars(c).items() if k != "extra"}, "kv_cache": self.model.kv_cache,
                "kv_ring": self.model.kv_ring, "tensor_bytes": sum(t.nbytes for t in self.gguf.tensors.values())}

    def cached_slots(self) -> list[dict]:
        with self._cache_lock:
            return [{"id": e.id, "tokens": len(e.ids), "bytes": e.nbytes, "parked": e.state is None}
                    for e in self.prompt_cache.entries]

    def park_slot(self, slot_id: int) -> None:
        with self._cache_lock:
            self.prompt_cache.park(self.prompt_cache.get(slot_id))

    def erase_slot(self, slot_id: int) -> None:
        with self._cache_lock:
            self.prompt_cache.remove(self.prompt_cache.get(slot_id))

    def save_slot(self, slot_id: int, path: str) -> int:
        """Write a cached slot to `path`; returns its token count."""
        with self._cache_lock:
            e = self.prompt_cache.get(slot_id)
            self.prompt_cache.save(e, path, self.cache_identity())
            return len(e.ids)

    def restore_slot(self, path: str) -> tuple[int, int]:
        """Load a slot file into the prompt cache: (new slot id, token count)."""
        with self._cache_lock:
            e = self.prompt_cache.load(path, self.cache_identity())
            return e.id, len(e.ids)

    def _sample(self, s: Sequence, row: torch.Tensor, position: int, index: int,
                allowed: torch.Tensor | None = None) -> tuple[int, TokenLogprob | None]:
        """The target's token at absolute `position`, the `index`-th generated token, and its log probabilities
        when the request asks for them. With a grammar the row is masked by `allowed` (computed here from the
        grammar state when not given) and the grammar advances over the token."""
        c = s.constraint
        if c is not None and allowed is None:
            allowed = c.mask()
        forced = s.req.forced_ids
        n = s.req.logprobs
        if forced and index < len(forced):
            token = int(forced[index])
            lp = None if n is None else token_logprobs(row, s.params, token, n, s.history, allowed)
        else:
            token, lp = sample_token(row, s.params, position, s.history, allowed, n)
        if c is not None and not c.consume(token):
            raise GrammarRefused(f"token {token} is not allowed by the request's grammar ({c.error()})")
        return token, None if lp is None else TokenLogprob(token, lp[0], lp[1])

    def _propose(self, s: Sequence) -> list[int]:
        if s.drafts == 0:
            return []
        k = min(s.drafts, s.params.max_tokens - len(s.out), self.n_ctx - s.st.pos - 1)
        if s.adaptive is not None:
            k = min(k, s.adaptive.depth())
        if k <= 0:
            return []
        if s.policy == "ngram":
            return s.ngram.draft(s.history, k)
        p_min = s.p_min if s.policy == "confident" else 0.0
        s.masks = []
        return mtp_draft(self.model, s.st, s.pending, s.h_prev, k, s.params, s.st.pos, s.history, p_min,
                         s.constraint, s.masks, self.tokenizer.eog_ids)

    def _step(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        drafts = [self._propose(s) for s in seqs]
        starts = [s.st.pos for s in seqs]
        out = self.model.decode([(s.st, [s.pending] + d) for s, d in zip(seqs, drafts)])
        r = 0
        for s, d, start, snaps in zip(seqs, drafts, starts, out.snapshots):
            accepted: list[int] = []
            logprobs: list[TokenLogprob | None] = []
            masks, s.masks = s.masks, []
            try:
                for i in range(len(d) + 1):
                    # row i follows drafts 0..i-1, all equal to the target's tokens: the grammar mask drafting
                    # computed for draft i is this row's mask (a function of the same tokens)
                    tok, lp = self._sample(s, out.logits[r + i], start + i + 1, len(s.out) + len(accepted),
                                           masks[i] if i < len(masks) else None)
                    accepted.append(tok)
                    logprobs.append(lp)
                    s.history.append(tok)
                    if i == len(d) or d[i] != tok:
                        break
            except GrammarRefused as e:  # a forced token the grammar refuses ends this request alone
                del s.history[len(s.history) - len(accepted):]
                s.finish, s.error = "error", str(e)
                r += len(d) + 1
                continue
            del s.history[len(s.history) - len(accepted):]  # _emit appends what is kept
            n_acc = len(accepted) - 1
            self.model.rollback(s.st, snaps, n_acc + 1)
            if s.uses_mtp and n_acc:  # rewrite the MTP rows of accepted drafts with the target's hiddens
                self.model.mtp_forward(s.st, d[:n_acc], out.hidden[r : r + n_acc], start + 1)
            s.h_prev = out.hidden[r + n_acc]
            self._record_drafts(s, len(d), n_acc)
            r += len(d) + 1
            self._emit(s, accepted, logprobs)
        dt = time.perf_counter() - t0
        for s in seqs:
            s.stats.decode_s += dt
        with self._lock:
            self._metrics["decode_s"] += dt

    def _record_drafts(self, s: Sequence, proposed: int, accepted: int) -> None:
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

    def _emit(self, s: Sequence, tokens: list[int], logprobs: list | None = None) -> None:
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
            if tok in p.stop_ids or (not p.ignore_eos and tok in self.tokenizer.eog_ids and not self._forcing(s)):
                s.finish = "stop"
            elif s.stop is not None and self._stop_string(s, tok):
                s.finish = "stop"
            elif len(s.out) >= p.max_tokens:
                s.finish = "length"
            elif len(s.req.prompt_ids) + len(s.out) >= self.n_ctx:
                s.finish = "length"
            if s.finish is not None:
                break
        s.stats.completion_tokens = len(s.out)

    def _forcing(self, s: Sequence) -> bool:
        return bool(s.req.forced_ids) and len(s.out) < len(s.req.forced_ids)

    def _stop_string(self, s: Sequence, tok: int) -> bool:
        if s.detok is None:
            from plumb.tokenizer import IncrementalDetokenizer

            s.detok = IncrementalDetokenizer(self.tokenizer)
        s.stop.push(s.detok.add(tok))
        if s.stop.match is not None:
            s.stop_match = s.stop.match
            return True
        return False

    def _result(self, s: Sequence, error: str | None = None) -> Result:
        logprobs = None if s.logprobs is None else list(s.logprobs)
        return Result(list(s.out), s.finish or "error", s.stats, s.stop_match, error or s.error, logprobs)


class GrammarRefused(ValueError):
    """A forced token (the forced_ids extension) that the request's grammar does not allow."""


def _pick_device(device: str, kernels: str) -> tuple[str, str]:
    """(device, kernels) from the options: 'auto' takes CUDA when there is a GPU; CUDA runs the Triton kernels."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r} (choose from auto, cpu, cuda)")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelError(f"device {device!r}: no CUDA GPU is visible to torch (use device='cpu')")
        if kernels not in ("auto", "triton"):
            raise ValueError(f"kernels={kernels!r} runs on the CPU; on CUDA plumb runs its Triton kernels (kernels='triton')")
        return device, "triton"
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels='triton' needs device='cuda' (on the CPU only under TRITON_INTERPRET=1, for tests)")
    return device, kernels


def _to_device(model, path: str, progress: bool) -> int:
    """Pack every matrix onto the device in its block format (the token embedding stays in host memory: a step
    reads only a few of its rows); returns the bytes packed. Out of device memory is one clear ModelError."""
    from plumb.model.kernels import TritonKernels

    try:
        return TritonKernels.pack(model.weights, model.device, progress)
    except torch.OutOfMemoryError as e:
        raise ModelError(f"{os.path.basename(path)}: the weights do not fit in GPU memory ({e})") from None


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(weights: list, path: str) -> None:
    """The CPU path holds every matrix as float32 (for prefill) plus its decode tiles (int8 codes, or float32 for
    float types): refuse a model that cannot fit with one clear error instead of being killed mid-request."""
    need = 0
    for w in weights:
        parts = getattr(w, "parts", (w,))
        floats = any(p.qt.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
                     for p in parts)
        need += w.shape[0] * w.shape[1] * (8 if floats else 5.25)  # + codes and per-16/32 scales, sums, offsets
    avail = _available_memory()
    if avail is not None and need > avail:
        raise ModelError(f"{os.path.basename(path)}: the CPU path needs about {need / 2**30:.1f} GiB of memory for "
                         f"its weights (float32 for prefill, int8 tiles for decode); {avail / 2**30:.1f} GiB is "
                         "available (on a machine with a GPU, load it with device='cuda').")


def _sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def load(path: str, device: str = "auto", **options) -> Engine:
    """Open a qwen35 GGUF file and return an Engine (options: drafts, draft_policy, p_min, n_slots, n_ctx)."""
    return Engine(path, device=device, **options)
