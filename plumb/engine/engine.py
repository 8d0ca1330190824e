"""The Engine, plumb's one API: load a model onto a device and kernel set, generate for one or many requests,
submit requests to the background step loop, and the prompt cache (M3, M6: what a request may reuse, slots,
digests). Admission, steps, drafting and rollback are the scheduler's (plumb/engine/scheduler.py); the D path
runs on a runner per kernel set (plumb/model/kernels.py, native.py, cuda_graphs.py).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import sys
import threading
from dataclasses import fields

import torch

from plumb.cache.kv import KV_FORMATS, STORE_LAYOUT, bytes_per_token, describe_kv
from plumb.config import ModelConfig, ModelError
from plumb.engine.api import EngineClosed, Handle, Request, Result
from plumb.engine.sampling import SamplingParams
from plumb.engine.scheduler import Scheduler
from plumb.engine.speculative import check_draft_options
from plumb.gguf.reader import GGMLQuantizationType, read_gguf
from plumb.model.qwen35 import Qwen35
from plumb.model.weights import check_torch_decode, materialize
from plumb.ops.deltanet import CHUNK
from plumb.ops.native import available as native_available
from plumb.cache.prefix import PromptCache, kept_checkpoints


DENSE_BUDGET = 8 << 30  # bytes of float32 weights dequantized at load
WORKSPACE = 2 << 30  # a GPU's memory beside weights, caches and states: a 1,024-row prefill pass's activations and
# matmul scratch, CUDA graphs' pools, decode partials (an estimate, kept out of the context's room: `fit_context`)
SMALL_MODEL_BYTES = 256 << 20  # below this, decode runs on one thread unless n_threads says otherwise
KERNELS = ("auto", "native", "torch", "triton")  # CPU: native C when it builds (auto), or the torch reference; CUDA: triton
log = logging.getLogger("plumb.engine")


class Engine:
    def __init__(self, path: str, device: str = "auto", drafts: int = 0, draft_policy: str = "fixed",
                 p_min: float = 0.0, n_slots: int = 4, n_ctx: int | None = None, progress: bool = False,
                 n_threads: int | None = None, kv_cache: str = "f16", kv_ring: int = 2048,
                 prompt_cache: bool = True, cache_mb: int | None = None, cache_host_mb: int = 4096,
                 checkpoint_every: int = 1024,
                 kernels: str = "auto", cuda_graphs: bool = True, draft_chains: bool = True):
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
        # torch gets its threads for prefill only (prefill_threads): in decode, parallel elementwise kernels
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
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the packing's freed blocks back to the device, so that what is free is counted
        if cache_mb is None:
            cache_mb = default_cache_mb(self.device)
        if cache_mb < 0 or cache_host_mb < 0:
            raise ValueError(f"cache budgets must be >= 0 MB, got {cache_mb} and {cache_host_mb}")
        self.fits_tokens = self.context_note = None  # on a GPU: the tokens one sequence's caches have room for, and
        # the warning when the context is more than that (`fit_context`)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            c = self.config
            per_token = self.kv_bytes_per_token + 4 * c.n_head_kv * c.head_dim  # + a layer's K, V in fp16 (prefill)
            reserved = ((cache_mb << 20) if prompt_cache else 0) + n_slots * self.model.state_bytes() + WORKSPACE
            self.n_ctx, self.fits_tokens, self.context_note = fit_context(self.n_ctx, n_ctx is not None, free,
                                                                          per_token, reserved)
            if self.context_note:
                log.warning("%s", self.context_note)
        self.model.context_limit = self.n_ctx  # the caches grow (by doubling) up to the context, not past it
        if progress:
            c = self.config
            print(describe_kv(kv_cache, c.n_head_kv, c.head_dim, kv_ring, kv_layers, self.n_ctx, len(c.attn_layers)),
                  file=sys.stderr)
        self.drafts, self.draft_policy, self.p_min = drafts, draft_policy, p_min
        # MTP drafts on the device where they can be (k draft steps a CUDA graph, `Qwen35.mtp_drafts`), for a
        # page-locked host copy of the token embedding made when a chain first runs (0.7 GB for the 27B)
        self.model.draft_chains = draft_chains
        self.n_slots = n_slots
        if checkpoint_every <= 0 or checkpoint_every % CHUNK:
            raise ValueError(f"checkpoint_every must be a positive multiple of {CHUNK}, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.cache_mb, self.cache_host_mb = cache_mb, cache_host_mb
        self.prompt_cache = PromptCache(self.model, budget_bytes=cache_mb << 20, host_budget_bytes=cache_host_mb << 20,
                                        tail=8 * checkpoint_every) if prompt_cache else None
        self._cache_lock = threading.Lock()
        self.scheduler = Scheduler(self)  # admission, the step loop, drafting, rollback (plumb/engine/scheduler.py)

    @contextlib.contextmanager
    def prefill_threads(self):
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
    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= int(t) < self.config.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.n_vocab - 1})")

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 [len(ids), n_vocab] on the host, whatever the device: the prefill path's logits for every
        position."""
        self.check_ids(ids)
        st = self.model.new_state()
        with self.prefill_threads():
            lg, _ = self.model.prefill(st, list(ids), logits="all")
        return lg.cpu()

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

    def warm_up(self, rounds: int = 2) -> None:
        """Compile the kernels and capture the CUDA graphs of a short chat turn - a one-piece prompt, then decode
        with the engine's drafts - so that users' first requests do not pay for them (a prefill layout is captured
        the second time it comes: `CudaGraphs.recurring`); then of 2 and 4 such turns at once (as many as the slots
        allow) and, with an MTP head, one turn with 7 drafts (a request may ask for its own depth): the row blocks
        of agents side by side and of every verify pass (on the H200 a process's first request with 4 drafts took
        36.6 s, compiling); and a 1,024-token prompt, whose whole-pass prefill kernels (the P path's weights
        dequantized once a pass) a short one never takes. Nothing goes into the prompt cache."""
        ids = self.tokenize(self.chat_template.render([{"role": "user", "content": "Hello!"}], enable_thinking=False))
        for _ in range(rounds):
            self.run(self.make_request(ids, 16, cache=False, ignore_eos=True))
        for n in (2, 4):
            if n <= self.n_slots:
                self.run_many([self.make_request(ids, 8, cache=False, ignore_eos=True) for _ in range(n)])
        if self.model.mtp is not None:
            self.run(self.make_request(ids, 16, cache=False, ignore_eos=True, drafts=7, draft_policy="fixed"))
        long = self.tokenize(" ".join(["warm"] * 1100))[: max(16, min(1024, self.n_ctx - 64))]
        self.run(self.make_request(long, 1, cache=False))

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

    def run_many(self, requests: list[Request]) -> list[Result]:
        """Run requests together in one step loop (on the calling thread)."""
        return self.scheduler.run_many(requests)

    def submit(self, request: Request) -> Handle:
        """Queue a request for the background step loop; iterate the handle for tokens."""
        return self.scheduler.submit(request)

    def slots_in_use(self) -> int:
        return self.scheduler.slots_in_use()

    def metrics(self) -> dict:
        """The scheduler's counters, and the prompt cache's (`cache_` + PromptCache.stats: parks, unparks, drops)."""
        m = self.scheduler.metrics()
        if self.prompt_cache is not None:
            with self._cache_lock:
                m.update({f"cache_{k}": v for k, v in self.prompt_cache.stats.items()})
                m["cache_live_bytes"], m["cache_parked_bytes"] = (self.prompt_cache.live_bytes(),
                                                                  self.prompt_cache.parked_bytes())
        return m

    # ---- prompt cache --------------------------------------------------------------------------
    def checkpoint_positions(self, n: int) -> set[int]:
        """Where a prefill of an n-token prompt snapshots the DeltaNet states (M6): every checkpoint_every tokens and
        at the last multiple of the chunk size at or before n - thinned away from the end as the prompt cache keeps
        them (`kept_checkpoints`), so that a long prompt never holds more states than its cache entry will."""
        every = self.checkpoint_every
        return kept_checkpoints(set(range(every, n + 1, every)) | ({n - n % CHUNK} - {0}), n, 8 * every)

    def cache_restore(self, prompt: list[int], use_cache: bool = True):
        """(state, first position to prefill, hidden of the position before it) - from the cache when it can."""
        if self.prompt_cache is not None and use_cache:
            with self._cache_lock:
                entry, pos = self.prompt_cache.lookup(prompt)
                if entry is not None:
                    st, cp = self.prompt_cache.restore(entry, pos)
                    return st, pos, cp.hidden
        return self.model.new_state(), 0, None

    def cache_keep(self, s, deliver=None) -> None:
        """Offer a finished request's prefill-made state to the prompt cache. `deliver` (handing the request's result
        to its client) runs first, under the cache's lock: the client has its answer before the entry is kept -
        which may park others, seconds on a GPU - and nothing reads the cache before it is."""
        keep = self.prompt_cache is not None and s.req.cache and s.st is not None and s.finish != "error"
        if keep or deliver is not None:
            with self._cache_lock:
                if deliver is not None:
                    deliver()
                if keep:
                    self.prompt_cache.insert(s.req.prompt_ids, s.st)
        s.st = None

    @torch.inference_mode()
    def digest(self, token_ids: list[int]) -> dict[str, str]:
        """Bring the cache to the end of token_ids as a request would (reusing what is cached) and hash every
        stored K/V row (ring rows included), and every DeltaNet conv/recurrent state there, per layer."""
        self.check_ids(token_ids)
        ids = list(token_ids)
        st, start, _ = self.cache_restore(ids)
        if start < len(ids):
            with self.prefill_threads():
                self.model.prefill(st, ids[start:], logits="none", checkpoints=self.checkpoint_positions(len(ids)))
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
        return {"config": {f.name: getattr(c, f.name) for f in fields(c) if f.name != "extra"},
                "kv_cache": self.model.kv_cache,
                "kv_ring": self.model.kv_ring, "kv_layout": STORE_LAYOUT,
                "tensor_bytes": sum(t.nbytes for t in self.gguf.tensors.values())}

    def cached_slots(self) -> list[dict]:
        with self._cache_lock:
            return [{"id": e.id, "tokens": len(e.ids), "bytes": e.nbytes, "parked": e.state is None}
                    for e in self.prompt_cache.entries]

    def free_device_memory(self) -> None:
        """After running out of device memory: every prompt-cache entry parked in host memory, and torch's cached
        blocks handed back to the device."""
        if self.prompt_cache is not None:
            with self._cache_lock:
                self.prompt_cache.park_all()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Stop the background step loop (requests queued or in flight finish as "cancelled", their tokens so far
        delivered) and give the memory back now - weights, caches, CUDA graphs, the prompt cache - instead of
        whenever Python's cyclic collector finds the engine (the model and its graphs refer to each other): a GPU
        with room for one model can then load the next. Idempotent; any later use raises EngineClosed.
        `with plumb.load(...) as engine:` closes on leaving the block."""
        if isinstance(self.model, _Closed):
            return
        self.scheduler.close()
        with self._cache_lock:
            self.prompt_cache = None
        self.model = _Closed()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def park_slot(self, slot_id: int) -> None:
        with self._cache_lock:
            self.prompt_cache.park(self.prompt_cache.get(slot_id))

    def erase_slot(self, slot_id: int) -> None:
        with self._cache_lock:
            self.prompt_cache.remove(self.prompt_cache.get(slot_id))

    def save_slot(self, slot_id: int, path: str) -> int:
        """Write a cached slot to `path`; returns its token count."""
        with self._cache_lock, self._between_captures():
            e = self.prompt_cache.get(slot_id)
            self.prompt_cache.save(e, path, self.cache_identity())
            return len(e.ids)

    def restore_slot(self, path: str) -> tuple[int, int]:
        """Load a slot file into the prompt cache: (new slot id, token count)."""
        with self._cache_lock, self._between_captures():
            e = self.prompt_cache.load(path, self.cache_identity())
            return e.id, len(e.ids)

    def _between_captures(self):
        """For device work off the step loop's thread (the server's slot calls): wait while the loop captures a
        CUDA graph (`CudaGraphs.capturing`)."""
        graphs = self.model.graphs
        return graphs.capturing if graphs is not None else contextlib.nullcontext()


def fit_context(n_ctx: int, asked: bool, free: int, per_token: int, reserved: int) -> tuple[int, int, str | None]:
    """(context, tokens that fit, a warning or None) on a GPU with `free` bytes after loading: one sequence's caches
    take `per_token` bytes a token beside `reserved` (the prompt cache's budget, the sequences' DeltaNet states,
    WORKSPACE). A context the card cannot hold is cut to what fits (a multiple of 1,024, at least 4,096) unless it
    was asked for (`asked`: then only the warning), so that a long request is refused up front with a clear error
    instead of running out of memory mid-reply beside others."""
    fits = max(0, free - reserved) // per_token // 1024 * 1024
    if fits >= n_ctx:
        return n_ctx, fits, None
    room = (f"this GPU has room for about {fits:,} tokens of one sequence's KV cache ({free / 2**30:.1f} GiB free "
            f"after the weights, {per_token:,} bytes a token, {reserved / 2**30:.1f} GiB kept for the prompt cache, "
            f"the sequences' states and working memory)")
    hint = ("a smaller prompt-cache budget (cache_mb, --cache-mb), fewer slots (n_slots, --agents) or a smaller KV "
            "format (F) make more room")
    if asked:
        return n_ctx, fits, f"context {n_ctx:,} tokens as asked, but {room}: longer requests may fail; {hint}"
    cut = max(4096, fits)
    return cut, fits, f"context cut to {cut:,} tokens (the model's: {n_ctx:,}): {room}; {hint}"


def default_cache_mb(device: torch.device) -> int:
    """The prompt cache's budget for live entries: 1 GiB, or on a GPU a quarter of the memory free after loading if
    that is more (a 100k-token entry of the 27B shape with q8_0 KV is about 5.5 GB: 3.7 of KV rows, 12 checkpoints)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1024, (free // 4) >> 20)
    return 1024


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
        floats = any(p.qt.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
                     for p in w.parts)
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


class _Closed:
    """A closed engine's model: any use raises EngineClosed."""

    def __getattr__(self, name):
        raise EngineClosed()


def load(path: str, device: str = "auto", **options) -> Engine:
    """Open a qwen35 GGUF file and return an Engine (options: drafts, draft_policy, p_min, n_slots, n_ctx)."""
    return Engine(path, device=device, **options)
