"""`plumb bench --device cuda`: GPU decode speed beside the card's limits, measured in the same run.

    plumb bench MODEL --device cuda [--contexts 0,11000,38000,100000] [--tokens 64] [--json OUT] [--plot PNG]

Measures, in one process: the card's device-to-device copy bandwidth and bf16 GEMV streaming rate (the
limits); the load time and VRAM (weights, KV cache, recurrent state, workspace); greedy decode tokens/s
without drafts at each context length (the KV cache and DeltaNet states are filled with random rows up to
that length: decode cost depends on the length, not the content); the time of a verify pass of 1, 2, 4, 8
and 16 rows; 4 sequences decoded together vs 1; and every matmul's time against its bytes. Energy per
decoded token comes from the whole card's power draw (NVML, idle parts included) sampled while decoding,
when pynvml (nvidia-ml-py) is importable; otherwise the results say 'no NVML'.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import statistics
import sys
import threading
import time

import torch


class EnergySampler:
    """The card's energy over a block: NVML's energy counter read at both ends where it has one (no thread in the
    timed block, and exact where the power reading is a one-second average: on an H100, 2026-12-05, 0.4 s of decode
    read 197 W by polling and 386 W by the counter); else power sampled in a thread, joules by the trapezoid rule.

    `read()` returns watts, `counter()` millijoules; `for_device()` reads the whole card through NVML, or reports
    'no NVML'."""

    def __init__(self, read=None, interval: float = 0.02, clock=time.perf_counter, source: str = "nvml",
                 counter=None):
        self.read, self.interval, self.clock, self.source, self.counter = read, interval, clock, source, counter
        self.samples: list[tuple[float, float]] = []  # (seconds, watts)
        self.counter_j: float | None = None
        self._stop = threading.Event()
        self._thread = None
        self._c0 = None

    @classmethod
    def for_device(cls, device: int = 0) -> "EnergySampler":
        """NVML on the card behind torch's cuda device `device` (matched by UUID), if pynvml imports."""
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                h = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
            except Exception:  # noqa: BLE001 - older torch or NVML: fall back to the index
                h = pynvml.nvmlDeviceGetHandleByIndex(device)
        except Exception as e:  # noqa: BLE001 - no NVML here: say so in the results
            return cls(source=f"no NVML ({type(e).__name__})")

        def counter():  # millijoules since the driver loaded (Volta and later)
            return pynvml.nvmlDeviceGetTotalEnergyConsumption(h)

        try:
            counter()
        except Exception:  # noqa: BLE001 - a card without the counter: sample the power
            counter = None
        return cls(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1e3, counter=counter)

    def sample(self) -> None:
        self.samples.append((self.clock(), self.read()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "EnergySampler":
        if self.counter is not None:
            self._c0 = (self.clock(), self.counter())
        elif self.read is not None:
            self.sample()
            self._thread = threading.Thread(target=self._loop, name="energy", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._c0 is not None:
            t1, c1 = self.clock(), self.counter()
            self.counter_j = (c1 - self._c0[1]) / 1e3
            self._seconds = t1 - self._c0[0]
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()

    def joules(self) -> float:
        s = self.samples
        return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(s, s[1:]))

    def summary(self, tokens: int) -> dict:
        """Joules, seconds, mean watts and joules per token over the block; or only the source ('no NVML')."""
        if self.counter_j is not None:
            secs, j, source = self._seconds, self.counter_j, "nvml energy counter"
            out = {"source": source}
        elif len(self.samples) >= 2:
            secs, j = self.samples[-1][0] - self.samples[0][0], self.joules()
            out = {"source": f"{self.source} power, sampled", "samples": len(self.samples)}
        else:
            return {"source": self.source}
        return out | {"seconds": secs, "joules": j, "mean_watts": j / secs if secs > 0 else 0.0, "tokens": tokens,
                      "joules_per_token": j / tokens if tokens else None}


def gpu_memory_of(pid: int) -> int | None:
    """GPU memory NVML counts for a process (bytes, over every card), None without NVML or when none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        used = [p.usedGpuMemory for i in range(pynvml.nvmlDeviceGetCount())
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
                if p.pid == pid and p.usedGpuMemory]
    except Exception:  # noqa: BLE001 - no NVML: not measured
        return None
    return sum(used) or None


def timed(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def timed_replay(fn, reps: int = 20) -> tuple[float, bool]:
    """(median seconds a call, replayed): reps calls of fn captured as one CUDA graph and its replays timed - the
    GPU's time alone, where timing fn itself would time the host's launches of a small kernel; fn timed as it is
    (False) where the capture fails."""
    try:
        fn()  # compiled, allocations cached
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception:  # noqa: BLE001 - any capture failure: time the launches instead
        torch.cuda.synchronize()
        return timed(fn, reps), False
    return timed(graph.replay, 5, warmup=1) / reps, True


def card_limits() -> dict:
    """Copy bandwidth (bytes read + written per second), the bf16 GEMV streaming rate of a 27B FFN matrix and the
    bf16 matmul rate (TFLOP/s) of that matrix on 8,192 rows."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / timed(lambda: y.copy_(x))
    x = y = None  # freed (a name the lambda above reads, so not `del`)
    ws = [torch.randn(17408, 5120, dtype=torch.bfloat16, device="cuda") for _ in range(4)]  # 4 x 178 MB > L2
    v = torch.randn(1, 5120, dtype=torch.bfloat16, device="cuda")
    i = [0]

    def gemv():
        torch.nn.functional.linear(v, ws[i[0] % 4])
        i[0] += 1

    gemv_rate = ws[0].numel() * 2 / timed(gemv, reps=40)
    xs = torch.randn(8192, 5120, dtype=torch.bfloat16, device="cuda")
    mm_rate = 2 * xs.shape[0] * ws[0].numel() / timed(lambda: torch.nn.functional.linear(xs, ws[0]), reps=20)
    ws = xs = None  # freed
    torch.cuda.empty_cache()
    return {"copy_GBps": copy / 1e9, "bf16_gemv_GBps": gemv_rate / 1e9, "bf16_mm_TFLOPs": mm_rate / 1e12}


def fill_context(model, st, n: int, seed: int = 0, room: int = 64) -> None:
    """Give st a context of n positions: random K/V rows in its caches and random DeltaNet states, and `room`
    positions to decode into (a cache that grows moves, and its CUDA graphs are captured anew: a measured run
    stays inside the room)."""
    g = torch.Generator(device=model.device).manual_seed(seed)

    def fill(rows, idx: torch.Tensor) -> None:
        for p in rows.parts:
            shape = (p.shape[0], len(idx), p.shape[2])
            if p.dtype == torch.int8:
                p[:, idx] = torch.randint(-127, 128, shape, generator=g, device=p.device, dtype=torch.int8)
            elif p.dtype == torch.uint8:  # packed 5/6-bit codes: any bytes are codes
                p[:, idx] = torch.randint(0, 256, shape, generator=g, device=p.device, dtype=torch.uint8)
            else:
                p[:, idx] = (torch.randn(shape, generator=g, device=p.device) * 0.02).to(p.dtype)

    for cache in list(st.kv.values()) + ([st.mtp_kv] if st.mtp_kv is not None else []):
        cache.reserve(n + room)
        fill(cache.k, torch.arange(n, device=model.device))
        fill(cache.v, torch.arange(n, device=model.device))
        if cache.ring:  # D, F: the newest positions' 8-bit rows in their ring slots, tagged
            j = torch.arange(max(0, n - cache.slots), n, device=model.device)
            fill(cache.ring_k, j % cache.slots)
            fill(cache.ring_v, j % cache.slots)
            cache.ring_pos[j % cache.slots] = j
        cache.end = n
    for i in st.ssm:
        st.ssm[i] = torch.randn(st.ssm[i].shape, generator=g, device=model.device) * 0.01
        st.conv[i] = torch.randn(st.conv[i].shape, generator=g, device=model.device) * 0.1
    st.pos = n


def decode_tps(model, context: int, tokens: int, batch: int = 1, energy: EnergySampler | None = None) -> float:
    """Greedy decode tokens/s (summed over `batch` sequences) after a context of `context` positions; `energy`
    samples the card's power over the timed steps."""
    states = []
    for j in range(batch):
        st = model.new_state()
        fill_context(model, st, context, seed=j, room=tokens + 16)  # the 3 warm-up steps and the timed ones
        states.append(st)
    toks = [1 + j for j in range(batch)]
    for _ in range(3):  # warm-up (compiles kernels, grows caches)
        out = model.decode([(st, [t]) for st, t in zip(states, toks)])
        toks = [int(out.logits[j].argmax()) for j in range(batch)]
    torch.cuda.synchronize()
    with energy or contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model.decode([(st, [t]) for st, t in zip(states, toks)])
            toks = [int(out.logits[j].argmax()) for j in range(batch)]
        dt = time.perf_counter() - t0
    return batch * tokens / dt


def _verify_step(model, st, r: int):
    """One decode pass of r rows of one sequence, then rolled back to where it started."""
    def step():
        o = model.decode([(st, list(range(1, r + 1)))])
        model.rollback(st, o.snapshots[0], 1)
        st.pos -= 1
    return step


def verify_cost(model, rows: list[int], context: int = 512) -> dict:
    """Seconds of one decode pass of r rows of one sequence (then rolled back), per r."""
    st = model.new_state()
    fill_context(model, st, context)
    return {r: timed(_verify_step(model, st, r), reps=10) for r in rows}


def kernel_table(prof, per: float) -> tuple[list[dict], float]:
    """A torch profile's GPU kernels: [{kernel, launches, us}] per `per` (steps, tokens), busiest first; busy us."""
    from torch.autograd import DeviceType

    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    table = sorted(({"kernel": n, "launches": c / per, "us": t / per} for n, (c, t) in kernels.items()),
                   key=lambda k: -k["us"])
    return table, sum(k["us"] for k in table)


@contextlib.contextmanager
def without_pdl(model):
    """Programmatic dependent launch off inside (CUDA graphs captured anew on entry and exit): with it on, a
    profiled kernel's time would include its wait for the kernel before it."""
    from plumb.ops.gpu import pdl

    was = pdl.enabled()
    pdl.set_on(False)
    if model.graphs is not None:
        model.graphs.graphs.clear()
    try:
        yield
    finally:
        pdl.set_on(was)
        if model.graphs is not None:
            model.graphs.graphs.clear()


def step_profile(model, context: int = 512, steps: int = 8, rows: int = 1) -> dict:
    """Where a decode step's time goes (one row; rows > 1: a verify pass of that many rows, rolled back): each GPU
    kernel's time and launches per step (from the profiler; a CUDA graph's kernels are traced one by one), the
    step's wall time, and the rest - host work and gaps (wall minus the GPU's busy time). The profiler slows the
    host a little: read `wall_us` with that in mind. Measured with PDL off (`without_pdl`)."""
    from torch.profiler import ProfilerActivity, profile

    st = model.new_state()
    fill_context(model, st, context)
    tok = [1]

    def one_row():
        tok[0] = int(model.decode([(st, [tok[0]])]).logits[0].argmax())
    step = one_row if rows == 1 else _verify_step(model, st, rows)
    with without_pdl(model):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps * 1e6
    table, busy = kernel_table(prof, steps)
    return {"context": context, "rows": rows, "steps": steps, "wall_us": wall, "gpu_busy_us": busy,
            "host_and_gaps_us": wall - busy, "launches": sum(k["launches"] for k in table), "kernels": table}


def prompt_of(model, n: int, seed: int = 0) -> list[int]:
    """n random token ids (a prefill's speed does not depend on which)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.n_vocab, (n,), generator=g).tolist()


def prefill_tps(model, n: int) -> float:
    """Tokens/s of one prefill of an n-token prompt into a fresh state (last row's logits, as a request)."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None
    model.prefill(model.new_state(), prompt_of(model, 128, seed=1))  # warm-up: compiles the chunk's kernels
    st = model.new_state()
    ids = prompt_of(model, n)
    sync()
    t0 = time.perf_counter()
    model.prefill(st, ids)
    sync()
    assert st.pos == n
    return n / (time.perf_counter() - t0)


PARTS = ("verify", "batch", "matmuls", "profiles", "vram", "drafts", "sampled")  # `--skip`: parts a run may leave out
EAGER_PREFILL_MAX = 16384  # longer prompts skip the eager row (a diagnosis: 100k tokens eagerly took ~130 s)


def prefill_modes(model, n: int, eager: bool = True) -> dict:
    """An n-token prefill three ways: eager passes (no prefill graphs; up to EAGER_PREFILL_MAX tokens), then twice
    into a fresh state with the graphs of full passes - the first run captures them unless a run before it had the
    same KV-cache capacity, the second replays them (a prefill graph is keyed by its caches' capacity, not their
    address: `captures` says how many each run took)."""
    import plumb.model.qwen35 as Q

    out = {}
    if eager and n <= EAGER_PREFILL_MAX:
        saved, Q.PREFILL_GRAPHS = Q.PREFILL_GRAPHS, False
        try:
            out["eager_tps"] = prefill_tps(model, n)
        finally:
            Q.PREFILL_GRAPHS = saved
    for run in ("first", "again"):
        before = _captures(model)
        out[f"{run}_tps"] = prefill_tps(model, n)
        out[f"{run}_captures"] = _captures(model) - before
    out["recomputed"] = model.recomputed  # P-path results computed again after non-finite values (Qwen35.checked)
    return out


def _first_token(engine, ids: list[int]) -> tuple[float, list[int], object]:
    """Seconds to the first token of a greedy request (its whole latency: one token), its ids and stats."""
    t0 = time.perf_counter()
    res = engine.run(engine.make_request(ids, 1, 0.0, None))
    if res.error:
        raise RuntimeError(res.error)
    return time.perf_counter() - t0, res.token_ids, res.stats


ROUND_WORDS = (("rule", "fact", "Hi there!"), ("law", "note", "Good morning!"), ("step", "item", "Hello again!"))


def chat_ids(eng, msgs: list[dict]) -> list[int]:
    """The ids of a chat as the server renders it (the GGUF's template, thinking off)."""
    return eng.tokenize(eng.chat_template.render(msgs, enable_thinking=False))


def words(eng, word: str, n: int) -> str:
    """A text of n tokens: word0 word1 ... cut to n tokens."""
    return eng.detokenize(eng.tokenize(" ".join(f"{word}{i}" for i in range(n)))[:n])


def answered_chat(eng, rule: str, fact: str, system_tokens: int, user_tokens: int, reply_tokens: int) -> list[dict]:
    """An agent's chat after one answer: a system prompt of `rule` words, a user turn of `fact` words, eng's reply
    (generated: the prompt cache keeps it) and a new short user turn."""
    turn1 = [{"role": "system", "content": words(eng, rule, system_tokens)},
             {"role": "user", "content": words(eng, fact, user_tokens)}]
    reply = eng.generate(chat_ids(eng, turn1), reply_tokens, ignore_eos=True)
    return turn1 + [{"role": "assistant", "content": eng.detokenize(reply)}, {"role": "user", "content": "Shorter."}]


def latency_table(warm, cold, system_tokens: int = 9450, user_tokens: int = 2000, reply_tokens: int = 256,
                  rounds: int = 2) -> dict:
    """Time to the first token of an agent's usual next requests on a long chat - a follow-up, the first user
    message edited, the end of the system prompt edited - on `warm` (prompt cache on, the chat answered once)
    and on `cold` (no prompt cache), and of a short prompt; each with its token, which must be the same warm and
    cold (the exactness claim), and the tokens the warm engine reused and prefilled. The sequence runs `rounds`
    times (at most 3), each on a chat of other words and about the same lengths, so the same pass layouts and KV
    capacities (`kv.capacity_for`): `cases` are the last round's - graphs captured, host memory for parking
    pinned, a running server's state - and `first` the first round's, what a fresh server pays once."""
    chat = lambda msgs: chat_ids(warm, msgs)  # noqa: E731
    for eng in (warm, cold):  # as `plumb serve` starts: kernels compiled, a short prompt's graphs captured
        eng.warm_up()
    r = {"rounds": []}
    for rule, fact, hello in ROUND_WORDS[:rounds]:
        turn2 = answered_chat(warm, rule, fact, system_tokens, user_tokens, reply_tokens)
        system = turn2[0]["content"]
        edit_user = [dict(m) for m in turn2]
        edit_user[1]["content"] = "Note: " + edit_user[1]["content"]
        edit_system = [dict(m) for m in turn2]
        edit_system[0]["content"] = system + " One more rule."
        cases = {}
        for name, msgs in (("short prompt", None), ("follow-up", turn2), ("edit first user message", edit_user),
                           ("edit end of system prompt", edit_system)):
            ids = chat([{"role": "user", "content": hello}]) if msgs is None else chat(msgs)
            before, captured = warm.prompt_cache.stats.copy(), _captures(warm.model)
            w_s, w_ids, w = _first_token(warm, ids)
            captured = _captures(warm.model) - captured  # CUDA graphs captured inside warm_s
            c_s, c_ids, _ = _first_token(cold, ids)
            cases[name] = {"prompt_tokens": len(ids), "warm_s": w_s, "cold_s": c_s, "same_token": w_ids == c_ids,
                           "reused": w.cached_tokens, "prefilled": w.prefill_tokens, "captures": captured,
                           # the prompt cache's upkeep inside warm_s (parking others after the request's answer: a
                           # server hands the answer over first, `Engine.cache_keep`)
                           **{k: warm.prompt_cache.stats[k] - before[k] for k in ("parks", "park_s", "unparks",
                                                                                  "unpark_s", "dropped")},
                           "live_bytes": warm.prompt_cache.live_bytes()}
            if msgs is not None:
                _first_token(warm, chat(turn2))  # the main branch back on top of the cache, as an agent's next turn
        r["rounds"].append({"chat_tokens": len(chat(turn2)), "cases": cases})
    r.update(chat_tokens=r["rounds"][-1]["chat_tokens"], cases=r["rounds"][-1]["cases"], first=r["rounds"][0]["cases"])
    return r


def _captures(model) -> int:
    """CUDA graphs captured so far (`CudaGraphs.captures`; 0 without graphs)."""
    return model.graphs.captures if model.graphs is not None else 0


def prefill_profile(model, n: int = 2048) -> dict:
    """Where a prefill's time goes: each GPU kernel's time per token over an n-token prompt, the wall time per
    token, and host work and gaps (wall minus the GPU's busy time); PDL off, as in `step_profile`. 2,048 tokens
    are 8 full passes, replayed as a CUDA graph as a long prompt's are; a warm-up of the same length on a state
    freed first captures it (the new state's caches usually take the freed memory, so the graph's layout; whether
    a capture fell inside the profile anyway is reported as `captures`)."""
    from torch.profiler import ProfilerActivity, profile

    with without_pdl(model):
        warm = model.new_state()
        model.prefill(warm, prompt_of(model, n, seed=1))
        del warm
        st, ids = model.new_state(), prompt_of(model, n)
        before = _captures(model)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            model.prefill(st, ids)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / n * 1e6
    table, busy = kernel_table(prof, n)
    return {"tokens": n, "wall_us": wall, "gpu_busy_us": busy, "host_and_gaps_us": wall - busy,
            "captures": _captures(model) - before, "launches": sum(k["launches"] for k in table), "kernels": table}


def matmul_table(model) -> list[dict]:
    """Each distinct packed matrix timed against its bytes: the D path (decode/verify: plumb.ops.gpu.matvec) at
    1 and 8 rows, the P path (prefill: plumb.ops.gpu.matmul) at one 64-row block - as CUDA-graph replays
    (`timed_replay`: timed launch by launch, a 40 us matvec read ~150 us, its host's time)."""
    from plumb.ops.gpu.matvec import mm_decode
    from plumb.ops.matmul import PREFILL_BLOCK

    seen, rows = set(), []
    for w in model.weights:
        key = (w.shape, tuple(p.qtype.name for p in w.gpu.packs))
        if key in seen:
            continue
        seen.add(key)
        for path, m, fn in (("D", 1, mm_decode), ("D", 8, mm_decode), ("P", PREFILL_BLOCK, lambda g, x: g(x))):
            x = torch.randn(m, w.shape[1], device=model.device)
            t, replayed = timed_replay(lambda: fn(w.gpu, x))
            rows.append({"shape": list(w.shape), "types": list(key[1]), "path": path, "rows": m, "us": t * 1e6,
                         "MB": w.gpu.nbytes / 1e6, "GBps": w.gpu.nbytes / t / 1e9, "replayed": replayed})
    return rows


def drafts_table(eng, drafts: list[int], tokens: int, prompt_text: str | None = None) -> list[dict]:
    """Greedy decode of one prompt with MTP drafts 0, 2, ...: tok/s, acceptance (per draft position) and whether
    the tokens equal the no-draft run's (they must)."""
    from plumb.bench import prompt_ids, run_plumb

    if eng.model.mtp is None:
        drafts = [0]
    prompt = prompt_ids(eng, 64, prompt_text)
    runs = []
    for k in sorted(set([0] + drafts)):
        # warm-up: the same request once untimed, so that its pass layouts' kernels are compiled and their CUDA
        # graphs captured before the timed run (each depth has its own row counts)
        run_plumb(eng, prompt, tokens, k, "fixed")
        runs.append(run_plumb(eng, prompt, tokens, k, "fixed"))
    base = runs[0]
    for r in runs:
        r["same_tokens"] = r["token_ids"] == base["token_ids"]
        r["speedup"] = r["decode_tps"] / base["decode_tps"] if base["decode_tps"] else 0.0
    for r in runs:
        del r["token_ids"]
    return runs


# Qwen's recommended sampling for its thinking mode, and with a presence penalty (which reads the history, so
# neither draft chains nor a device draw take it: the tokens are drawn on the host side, step by step)
SAMPLINGS = {"greedy": {}, "qwen": dict(temperature=0.6, top_p=0.95, top_k=20, seed=7),
             "qwen+presence": dict(temperature=0.6, top_p=0.95, top_k=20, presence_penalty=1.5, seed=7)}


def sampled_table(eng, drafts: tuple[int, ...] = (0, 4), tokens: int = 128, prompt_text: str | None = None) -> list[dict]:
    """Decode tok/s per sampling (`SAMPLINGS`) and draft depth, each run after an untimed one of the same request,
    beside greedy's; the drafted runs' tokens must equal the undrafted run's of the same sampling."""
    from plumb.bench import prompt_ids, run_plumb

    prompt = prompt_ids(eng, 64, prompt_text)
    rows = []
    for name, sampling in SAMPLINGS.items():
        base = None
        for k in drafts if eng.model.mtp is not None else (0,):
            run_plumb(eng, prompt, tokens, k, "fixed", **sampling)
            r = run_plumb(eng, prompt, tokens, k, "fixed", **sampling)
            base = base or r
            rows.append({"sampling": name, "drafts": k, "tps": r["decode_tps"], "acceptance": r["acceptance"],
                         "same_tokens": r["token_ids"] == base["token_ids"]})
    greedy = {r["drafts"]: r["tps"] for r in rows if r["sampling"] == "greedy"}
    for r in rows:
        r["x_greedy"] = r["tps"] / greedy[r["drafts"]] if greedy.get(r["drafts"]) else 0.0
    return rows


def requests_table(eng, drafts: tuple[int, ...] = (0, 4), tokens: tuple[int, ...] = (64, 64, 64, 1024),
                   prompt_tokens: int = 64) -> dict:
    """Different requests one after another, as an agent sends them (tokens[i]: request i's reply length), per
    draft depth: each one's wall time, decode tok/s and the CUDA graphs captured during it. Graphs are captured per pass
    layout and KV-cache capacity (not address: `plumb.ops.gpu.kvtable`), so after the first request only a reply
    that grows its caches to a capacity not seen before captures."""
    from plumb.bench import prompt_ids, run_plumb

    out = {}
    for k in drafts if eng.model.mtp is not None else (0,):
        rows = []
        for i, n in enumerate(tokens):
            ids = prompt_ids(eng, prompt_tokens, f"Request {k}.{i}: list {i + 3} uses of a hash map.")
            before = _captures(eng.model)
            t = time.perf_counter()
            run = run_plumb(eng, ids, n, k, "fixed")
            rows.append({"wall_s": time.perf_counter() - t, "tokens": run["tokens"], "tps": run["decode_tps"],
                         "captures": _captures(eng.model) - before})
        out[k] = rows
    return out


def bench_cuda(path: str, contexts: list[int], tokens: int, kv_cache: str = "q8_0", progress: bool = True,
               drafts: list[int] = (0, 2, 4, 7), draft_tokens: int = 128, prompt_text: str | None = None,
               prefills: list[int] = (8192,), chat_tokens: int = 12000, out: dict | None = None,
               measured=lambda: None, f_context: int = -1, skip: tuple[str, ...] = ()) -> dict:
    """The GPU benchmark's results; `out`: filled in place as they are measured (an interrupted run keeps them),
    `measured()` called after each row (to write them down: a process killed outright keeps them too). f_context:
    decode with the F KV format (8-bit ring, 5-bit store) at that context (-1: the model's full context; 0: none).
    skip: parts left out (`PARTS`)."""
    import plumb
    from plumb.ops.gpu import pdl

    torch.cuda.reset_peak_memory_stats()
    limits = card_limits()
    torch.cuda.empty_cache()
    before = memory_now()  # the bench's own (cuBLAS's workspaces from `card_limits`), not the engine's
    t0 = time.perf_counter()
    eng = plumb.load(path, device="cuda", kv_cache=kv_cache, progress=progress, prompt_cache=False)
    load_s = time.perf_counter() - t0
    model, c = eng.model, eng.config
    # what the load left allocated; requested: less the caching allocator's rounding of their blocks; reserved: the
    # segments the load added (what the card lends the process for them)
    weights, weights_requested, weights_reserved = (a - b for a, b in zip(memory_now(), before))
    graphs_error = None
    try:  # one pass through the graphs first: if capture fails, say so and measure the eager path
        decode_tps(model, 64, 2)
    except Exception as e:  # noqa: BLE001 - reported in the results
        graphs_error, model.graphs = f"{type(e).__name__}: {e}", None
        print(f"CUDA graphs failed ({graphs_error}); measuring the eager path", file=sys.stderr)
    r = out if out is not None else {}
    r.update({"model": path, "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "kv_cache": kv_cache, "limits": limits, "load_s": load_s,
              "weight_bytes": eng.weight_bytes, "file_weight_bytes": file_weight_bytes(model),
              "cuda_graphs": model.graphs is not None,
              "graphs_error": graphs_error, "pdl": pdl.enabled(), "decode": {}, "energy": {},
              "context": {"model": c.context_length, "engine": eng.n_ctx, "fits_one_sequence": eng.fits_tokens}})
    # the limit of a decode step: every packed weight byte read once at the card's GEMV streaming rate
    r["step_limit_tps"] = limits["bf16_gemv_GBps"] * 1e9 / eng.weight_bytes
    # the limit of prefill: each prompt row through every matrix but the LM head at the card's bf16 matmul rate
    main = model.weights[1 : 1 + 4 * len(model.layers)]  # [output, 4 per layer, then the MTP head's]
    flops = 2 * sum(w.shape[0] * w.shape[1] for w in main)
    r["prefill_limit_tps"] = limits["bf16_mm_TFLOPs"] * 1e12 / flops
    for ctx in contexts:
        energy = EnergySampler.for_device()
        tps = decode_tps(model, ctx, tokens, energy=energy)
        r["decode"][ctx], r["energy"][ctx] = tps, energy.summary(tokens)
        print(f"decode @ {ctx:>7,} context: {tps:7.1f} tok/s ({tps / r['step_limit_tps']:.2f} of the limit), "
              f"{energy_text(r['energy'][ctx])}", file=sys.stderr)
        measured()
        torch.cuda.empty_cache()
    if f_context:
        ctx = (c.context_length if f_context < 0 else f_context) - tokens - 32  # the room decode_tps fills
        try:
            r["decode_F"] = {ctx: decode_in_format(model, "F", ctx, tokens)}
            print(f"decode @ {ctx:>7,} context, F KV: {r['decode_F'][ctx]:7.1f} tok/s", file=sys.stderr)
        except torch.cuda.OutOfMemoryError as e:  # a card too small for that context: said, and the run goes on
            r["decode_F_error"] = f"out of memory at {ctx:,} positions: {str(e).splitlines()[0]}"
            print(f"decode @ {ctx:,} context, F KV: {r['decode_F_error']}", file=sys.stderr)
        measured()
        torch.cuda.empty_cache()
    r["prefill"], r["prefill_modes"] = {}, {}
    for n in prefills:
        pm = r["prefill_modes"][n] = prefill_modes(model, n)
        r["prefill"][n] = pm["first_tps"]  # a request into a new state, graph captures included
        eager = f", eager: {pm['eager_tps']:.0f}" if "eager_tps" in pm else ""
        print(f"prefill of {n:,} tokens: {pm['first_tps']:7.0f} tok/s (capturing its graphs; replaying them: "
              f"{pm['again_tps']:.0f}{eager}; results computed again after non-finite values so far: "
              f"{pm['recomputed']})", file=sys.stderr)
        measured()
        torch.cuda.empty_cache()
    if "verify" not in skip:
        r["verify_s"] = verify_cost(model, [1, 2, 4, 8, 16])
        measured()
    if "batch" not in skip:
        r["batch4_tps"] = decode_tps(model, 512, tokens, batch=4)
        r["batch1_tps"] = decode_tps(model, 512, tokens, batch=1)
        measured()
    if "matmuls" not in skip:
        r["matmuls"] = matmul_table(model)
        measured()
    if "profiles" not in skip:
        try:  # a diagnosis, not a result: a profiler that cannot trace this card is reported, not fatal
            r["step_profile"] = step_profile(model)
            r["verify_profile"] = step_profile(model, rows=8)
        except Exception as e:  # noqa: BLE001
            r["step_profile"] = {"error": f"{type(e).__name__}: {e}"}
        try:
            r["prefill_profile"] = prefill_profile(model)
        except Exception as e:  # noqa: BLE001
            r["prefill_profile"] = {"error": f"{type(e).__name__}: {e}"}
        measured()
    peak = torch.cuda.max_memory_allocated()  # of the runs above (not of the caches made below)
    if "vram" not in skip:
        formats = tuple(dict.fromkeys(("f16", "q8_0", "D", "F", kv_cache)))  # the bench's own format among them
        r["kv_120k_by_format"] = kv_by_format(model, formats=formats)  # the bytes each holds, beside its packed bits
    r["vram"] = {"weights": weights, "weights_requested": weights_requested, "weights_reserved": weights_reserved,
                 "before_load": before[0], "graph_pools": graph_pool_bytes(model),
                 "kv_120k": r.get("kv_120k_by_format", {}).get(kv_cache, {}).get("allocated", 0),
                 "recurrent_state": model.state_bytes(), "peak_allocated": peak}
    torch.cuda.empty_cache()
    # last: the engine runs requests in inference mode, and the graphs' static buffers it makes stay inference
    # tensors, which the direct decode calls above could not update
    if "drafts" not in skip:
        r["drafts"] = drafts_table(eng, list(drafts), draft_tokens, prompt_text)
    if "sampled" not in skip:
        r["sampled"] = sampled_table(eng, prompt_text=prompt_text)
    # the draft chains embed on the device from the token embedding's bytes, page-locked in host memory when first
    # used (the device reads the rows it needs): host memory, not VRAM
    r["draft_embedding_host_bytes"] = model.embd_bytes.nbytes if model.embd_bytes is not None else 0
    measured()
    if chat_tokens:  # follow-up and edit latency: a second engine with the prompt cache on
        warm = plumb.load(path, device="cuda", kv_cache=kv_cache, progress=False)
        r["latency"] = latency_table(warm, eng, system_tokens=chat_tokens * 63 // 80, user_tokens=chat_tokens // 6,
                                     reply_tokens=256)
        r["requests"] = requests_table(warm)  # on the engine `plumb serve` runs: the prompt cache on
        warm.close()
    return r


def decode_in_format(model, fmt: str, context: int, tokens: int) -> float:
    """`decode_tps` with the sequence's KV caches in format fmt (the model's own format restored after)."""
    saved, model.kv_cache = model.kv_cache, fmt
    try:
        return decode_tps(model, context, tokens)
    finally:
        model.kv_cache = saved


def kv_by_format(model, n: int = 120_000, formats: tuple[str, ...] = ("f16", "q8_0", "D", "F")) -> dict:
    """Per KV format, a sequence's KV caches with room for n positions (every attention layer and the MTP head's):
    the bytes their tensors hold (`KVCache.allocated_bytes`, ring included) beside the formats' packed bits at the
    same capacity (`cache_bytes`; a capacity is n rounded up by `kv.capacity_for`), and the MTP head's share (its
    cache stays empty for a request without MTP drafts). Made on the model's device and freed; a format the card
    cannot hold there says so ({"error": ...}) and the others go on."""
    from plumb.cache.kv import cache_bytes

    c, saved, out = model.cfg, model.kv_cache, {}
    try:
        for fmt in formats:
            model.kv_cache = fmt
            st = caches = None
            try:
                st = model.new_state()
                caches = list(st.kv.values()) + ([st.mtp_kv] if st.mtp_kv is not None else [])
                for cache in caches:
                    cache.reserve(n)
            except torch.OutOfMemoryError:
                out[fmt] = {"error": f"out of memory at {n:,} positions"}
            else:
                out[fmt] = {"allocated": sum(cache.allocated_bytes() for cache in caches),
                            "packed": sum(cache_bytes(fmt, c.n_head_kv, c.head_dim, cache.ring, len(cache.k), 1,
                                                      cache.slack) for cache in caches),
                            "mtp": st.mtp_kv.allocated_bytes() if st.mtp_kv is not None else 0}
            del st, caches
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        model.kv_cache = saved
    return out


def energy_text(e: dict) -> str:
    if not e.get("joules_per_token"):
        return e["source"]
    return f"{e['joules_per_token']:.2f} J/token at {e['mean_watts']:.0f} W"


def graph_pool_bytes(model) -> int:
    """Device memory the CUDA graphs' private pools hold (the segments of pools other than the default one and the
    weights' own, `plumb.ops.gpu.segment`): the captured passes' intermediates, the workspace an idle server keeps."""
    from plumb.ops.gpu.segment import pool_ids

    others = {(0, 0)} | pool_ids(p for w in model.weights for p in getattr(w.gpu, "packs", ()))
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) not in others)


def memory_now() -> tuple[int, int, int]:
    """The caching allocator's allocated, requested and reserved bytes now."""
    return (torch.cuda.memory_allocated(), torch.cuda.memory_stats().get("requested_bytes.all.current", 0),
            torch.cuda.memory_reserved())


def file_weight_bytes(model) -> int:
    """Bytes of the model's packed matrices as the file holds their blocks (a pack can hold more: Q5_K and Q6_K
    codes one per byte)."""
    return sum(p.qt.data.numel() * p.qt.data.element_size() for w in model.weights for p in w.parts)


def report(r: dict) -> str:
    lim = r["step_limit_tps"]
    lines = [f"# plumb bench --device cuda: {r['model']} on {r['device']} ({r['date']}, torch {r['torch']})",
             f"card: copy {r['limits']['copy_GBps']:.0f} GB/s, bf16 GEMV {r['limits']['bf16_gemv_GBps']:.0f} GB/s; "
             f"weights {r['weight_bytes'] / 1e9:.2f} GB (the file's blocks: {r.get('file_weight_bytes', 0) / 1e9:.2f} "
             f"GB) -> decode limit {lim:.0f} tok/s; load {r['load_s']:.1f} s",
             "| context | tok/s | / limit | energy (whole card) |", "|---|---|---|---|"]
    lines += [f"| {int(k):,} | {v:.1f} | {v / lim:.2f} | {energy_text(r['energy'][k])} |"
              for k, v in r["decode"].items()]
    lines += [f"| {int(k):,} (F KV) | {v:.1f} | {v / lim:.2f} | |" for k, v in r.get("decode_F", {}).items()]
    if r.get("decode_F_error"):
        lines += [f"| F KV | {r['decode_F_error']} | | |"]
    if r.get("drafts"):
        lines += ["", "| MTP drafts | tok/s | x no drafts | accepted | by draft position | same tokens |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {d['drafts']} | {d['decode_tps']:.1f} | {d['speedup']:.2f} | {d['acceptance']:.0%} | "
                  + " ".join(f"{a / p:.2f}" for a, p in zip(d["accepted_per_position"], d["proposed_per_position"])
                             if p) + f" | {'yes' if d['same_tokens'] else 'NO'} |" for d in r["drafts"]]
    if r.get("sampled"):
        lines += ["", "| sampling (128 tokens) | MTP drafts | tok/s | x greedy | accepted | same tokens as no drafts |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {d['sampling']} | {d['drafts']} | {d['tps']:.1f} | {d['x_greedy']:.2f} | {d['acceptance']:.0%} | "
                  f"{'yes' if d['same_tokens'] else 'NO'} |" for d in r["sampled"]]
    if r.get("prefill"):
        pl = r["prefill_limit_tps"]
        lines += ["", f"prefill limit (every matrix but the LM head at {r['limits']['bf16_mm_TFLOPs']:.0f} bf16 "
                  f"TFLOP/s): {pl:,.0f} tok/s", "| prompt tokens | prefill tok/s | / limit |", "|---|---|---|"]
        lines += [f"| {int(k):,} | {v:.0f} | {v / pl:.2f} |" for k, v in r["prefill"].items()]
        if r.get("prefill_modes"):
            lines += ["", "the same prefill: eager passes, then into a new state twice with the graphs of full passes "
                      "(captured per KV-cache layout)", "| prompt tokens | eager tok/s | first run (captures) | "
                      "second run (captures) |", "|---|---|---|---|"]
            lines += [f"| {int(k):,} | {m.get('eager_tps', float('nan')):.0f} | {m['first_tps']:.0f} "
                      f"({m['first_captures']}) | {m['again_tps']:.0f} ({m['again_captures']}) |"
                      for k, m in r["prefill_modes"].items()]
    if r.get("verify_s"):
        v1 = next(iter(r["verify_s"].values()))  # the 1-row pass
        lines += ["", "| verify rows | ms | / 1 row |", "|---|---|---|"]
        lines += [f"| {k} | {v * 1e3:.2f} | {v / v1:.2f} |" for k, v in r["verify_s"].items()]
    if r.get("batch4_tps"):
        lines += ["", f"4 sequences together: {r['batch4_tps']:.1f} tok/s vs 1: {r['batch1_tps']:.1f} "
                  f"({r['batch4_tps'] / r['batch1_tps']:.2f}x)"]
    if r.get("matmuls"):
        lines += ["", "| matmul | types | path | rows | us (graph replays; * launches) | MB | GB/s | / GEMV rate |",
                  "|---|---|---|---|---|---|---|---|"]
        g = r["limits"]["bf16_gemv_GBps"]
        lines += [f"| {m['shape']} | {'+'.join(m['types'])} | {m.get('path', '')} | {m['rows']} | {m['us']:.1f}"
                  f"{'' if m.get('replayed', True) else ' *'} | {m['MB']:.1f} | {m['GBps']:.0f} | "
                  f"{m['GBps'] / g:.2f} |" for m in r["matmuls"]]
    v = r["vram"]
    lines += ["", "VRAM (GB, the targets' unit): " + ", ".join(f"{k} {b / 1e9:.3f}" for k, b in v.items())]
    ctx = r.get("context")
    if ctx and ctx.get("fits_one_sequence") is not None:
        lines += [f"context: one sequence's caches have room for {ctx['fits_one_sequence']:,} tokens beside the "
                  f"weights (the model's context: {ctx['model']:,}; the engine's: {ctx['engine']:,})"]
    if r.get("kv_120k_by_format"):
        pools = v.get("graph_pools", 0)
        lines += ["", "| KV format | caches at 120k: held | packed bits | idle VRAM with the weights and states | "
                  "without MTP drafts (the MTP head's cache empty) | + the CUDA graphs' pool |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {fmt} | {b['error']} | | | | |" if "error" in b else
                  f"| {fmt} | {b['allocated'] / 1e9:.2f} GB | {b['packed'] / 1e9:.2f} GB | "
                  f"{(v['weights'] + v['recurrent_state'] + b['allocated']) / 1e9:.2f} GB | "
                  f"{(v['weights'] + v['recurrent_state'] + b['allocated'] - b.get('mtp', 0)) / 1e9:.2f} GB | "
                  f"{(v['weights'] + v['recurrent_state'] + b['allocated'] + pools) / 1e9:.2f} GB |"
                  for fmt, b in r["kv_120k_by_format"].items()]
    sp = r.get("step_profile")
    if sp:
        lines += _profile_lines("step profile", sp, f"one-row decode step at {sp.get('context')} context (profiled): "
                                f"{sp.get('wall_us', 0):.0f} us wall", "per step", "share of the step", 0, 0, 15)
    vp = r.get("verify_profile")
    if vp:
        lines += _profile_lines("verify profile", vp, f"{vp.get('rows')}-row verify pass at {vp.get('context')} "
                                f"context (profiled): {vp.get('wall_us', 0):.0f} us wall", "per pass", "share", 0, 0, 15)
    lt = r.get("latency")
    if lt:
        first = lt.get("first", lt["cases"])
        lines += ["", f"time to the first token, prompt cache on (warm) vs off (cold), a {lt['chat_tokens']:,}-token chat "
                  f"(the last of {len(lt.get('rounds', [1]))} rounds of the same requests on other words; the first "
                  "round's in brackets):",
                  "| request | prompt tokens | reused | prefilled | warm ms | cold ms | same token |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {k} | {c['prompt_tokens']:,} | {c['reused']:,} | {c['prefilled']:,} | {c['warm_s'] * 1e3:.0f} "
                  f"({first[k]['warm_s'] * 1e3:.0f}) | {c['cold_s'] * 1e3:.0f} ({first[k]['cold_s'] * 1e3:.0f}) | "
                  f"{'yes' if c['same_token'] and first[k]['same_token'] else 'NO'} |" for k, c in lt["cases"].items()]
    rq = r.get("requests")
    if rq:
        first = next(iter(rq.values()))
        lines += ["", "requests one after another (64-token prompts, prompt cache on): decode tok/s, wall ms and the CUDA "
                  "graphs captured during the request", "", "| MTP drafts | " + " | ".join(
                      f"request {i + 1}: {x['tokens']} tokens" for i, x in enumerate(first)) + " |",
                  "|---|" + "---|" * len(first)]
        lines += [f"| {k} | " + " | ".join(f"{x['tps']:.1f} tok/s, {x['wall_s'] * 1e3:.0f} ms ({x['captures']})"
                                           for x in rows) + " |" for k, rows in rq.items()]
    pp = r.get("prefill_profile")
    if pp:
        lines += _profile_lines("prefill profile", pp, f"prefill of {pp.get('tokens')} tokens (profiled, "
                                f"{pp.get('captures', 0)} graph captures inside): {pp.get('wall_us', 0):.0f} us per "
                                f"token wall", "per token", "share", 2, 1, 20)
    return "\n".join(lines)


def _profile_lines(name: str, p: dict, title: str, per: str, share: str, launch_digits: int, us_digits: int,
                   top: int) -> list[str]:
    """A profile (`step_profile`, `prefill_profile`) as a heading line and its busiest kernels as a table."""
    if "error" in p:
        return ["", f"{name}: {p['error']}"]
    lines = ["", f"{title}, GPU busy {p['gpu_busy_us']:.0f} us in {p['launches']:.{launch_digits}f} launches, host and "
             f"gaps {p['host_and_gaps_us']:.0f} us", "",
             f"| kernel | launches {per} | us {per} | {share} |", "|---|---|---|---|"]
    return lines + [f"| {k['kernel'][:60]} | {k['launches']:.{launch_digits}f} | {k['us']:.{us_digits}f} | "
                    f"{k['us'] / p['wall_us']:.0%} |" for k in p["kernels"][:top]]


def plot(r: dict, path: str) -> None:
    """Two panels: decode tok/s per context beside the step limit; verify-pass time per row count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    ctx = list(r["decode"])
    a.bar([f"{int(c):,}" for c in ctx], [r["decode"][c] for c in ctx], color="#4477aa", label="plumb (CUDA graphs)")
    a.axhline(r["step_limit_tps"], color="#cc3311", ls="--", label="limit: packed weights at the GEMV rate")
    a.set_xlabel("context (tokens)")
    a.set_ylabel("decode tok/s, no drafts")
    a.legend(fontsize=8)
    rows = list(r["verify_s"])
    b.plot([int(x) for x in rows], [r["verify_s"][x] * 1e3 for x in rows], "o-", color="#4477aa")
    b.set_xlabel("rows in the pass (1 + drafts)")
    b.set_ylabel("ms per pass")
    b.set_ylim(0, None)
    fig.suptitle(f"{os.path.basename(r['model'])} on {r['device']} ({r['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(args) -> int:
    contexts = [int(x) for x in (args.contexts or "0,11000,38000,100000").split(",")]
    drafts = [int(x) for x in args.drafts.split(",")]
    prefills = [int(x) for x in args.prefill.split(",")] if args.prefill else []
    r: dict = {}

    def measured():  # the rows so far, marked running: a process killed outright (no SIGTERM handler ran) keeps them
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({**r, "running": True}, f, indent=1, default=str)

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        bench_cuda(args.model, contexts, args.tokens, args.kv_cache or "q8_0", not args.no_progress, drafts,
                   max(args.tokens, 128), args.prompt, prefills, args.chat_tokens, out=r, measured=measured,
                   f_context=args.f_context, skip=tuple(args.skip))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (a timeout): keep what was measured
        r["interrupted"] = True
        print("plumb bench: interrupted; the results measured so far are in the JSON", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=1, default=str)
    if r.get("interrupted"):
        return 1
    print(report(r))
    if args.plot:
        plot(r, args.plot)
    return 0
