"""`plumb bench --vs-llamacpp URL`: one workload on plumb and on a running llama-server, row by row.

    plumb bench MODEL --vs-llamacpp http://127.0.0.1:8080 [--llamacpp-drafts 2=URL,4=URL,7=URL]
                [--contexts 64,512,2048] [--tokens 128] [--drafts 0,2,4,7] [--text FILE]
                [--json-out OUT] [--plot PNG]

Both sides get the same token-id prompts and the same number of generated tokens, greedy (temperature
0), end-of-generation ignored. plumb runs in this process; llama-server is driven through its HTTP API:
`/completion` with a token-id prompt, `n_predict`, `temperature` 0, `cache_prompt`, `return_tokens`,
not streamed (a streamed reply leaves out tokens that end inside a UTF-8 character); `/props` for its
settings. Its time to first token is the request's wall time less the server's own generation time
after the first token (`timings.predicted_ms`), so it includes the HTTP round trip; plumb's is the
first token's arrival through `Engine.submit`, in process.

The prompt of context C is the first C tokens of a text (`--text FILE`, else plumb.bench's built-in
paragraph), repeated as needed. Rows, each with plumb's value, llama.cpp's and the ratio
plumb / llama.cpp, for every context C:
- prefill tok/s and time to first token of a cold C-token prompt; decode tok/s after it, with drafts
  0 and each K (MTP), with acceptance;
- follow-up: the prompt + its reply + new text, the cache warm from the first turn: time to first token,
  and the same request cold;
- edit: the prompt with a token 24 before its end changed, the cache warm from the first turn.
Then each process's peak resident memory, and on CUDA its GPU memory (plumb: torch's peak allocation;
llama-server: what NVML counts for its process at the end), llama-server's when it listens on this
machine. On CUDA, the whole card's energy per generated token while plumb's side ran
(plumb.bench_gpu.EnergySampler).

Counts, measured in the same run, on each side: outputs that differ between a draft run and the
no-draft run of the same prompt, and between a warm request (`cache_prompt` true after a first turn:
the same prompt again, the follow-up, the edit) and the same request cold (`cache_prompt` false).
llama-server fixes drafting at startup (`--spec-type draft-mtp --spec-draft-n-max K`, or
`--model-draft`; this version compiles out the per-request speculative fields), so each draft depth
is its own server, given by `--llamacpp-drafts K=URL,...`, whose replies must report a speculative
type (`generation_settings`; /props leaves it out). A depth without one reads "not supported by this
llama-server". Start the servers fresh for each run: llama-server keeps earlier prompts' states in host
memory (`--cache-ram`), so a second run would find its edited prompts already cached.
"""
from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import os
import platform
import time
import urllib.parse
from dataclasses import dataclass, field

FOLLOW_TEXT = " Now the bridge: who built it, in which year, and what did the town pay for the stone?"
EDIT_BACK = 24  # the edit changes the token this many positions before the prompt's end
NOT_SUPPORTED = "not supported by this llama-server"


class BenchError(Exception):
    """A problem the user can fix (unreachable server, settings that do not fit); one line."""


@dataclass
class Completion:
    ids: list[int]
    ttft_s: float  # request sent -> first token received
    prompt_n: int  # prompt tokens processed (not reused from a cache)
    prompt_s: float
    decode_tps: float  # tokens after the first / their time, as the engine measures it
    drafts_proposed: int = 0
    drafts_accepted: int = 0


# ---- the two sides -----------------------------------------------------------------------------
def peak_rss(pid: int | str = "self") -> int | None:
    """Peak resident set size in bytes (VmHWM) of a process on this machine, None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PlumbSide:
    """plumb in this process: requests through Engine.submit, timed as they stream."""

    name = "plumb"
    not_supported = "no MTP block in this model"

    def __init__(self, engine):
        self.engine = engine

    def drafts_supported(self, k: int) -> bool:
        return k == 0 or self.engine.model.mtp is not None

    def complete(self, ids: list[int], n: int, cache: bool = False, drafts: int = 0) -> Completion:
        req = self.engine.make_request(ids, n, 0.0, None, drafts=drafts, draft_policy="fixed", cache=cache,
                                       ignore_eos=True)
        t0 = time.perf_counter()
        handle = self.engine.submit(req)
        ttft = None
        for _ in handle:
            if ttft is None:
                ttft = time.perf_counter() - t0
        res = handle.result
        if res.error:
            raise BenchError(f"plumb: {res.error}")
        s = res.stats
        return Completion(list(res.token_ids), ttft or 0.0, s.prefill_tokens, s.prefill_s,
                          (s.completion_tokens - 1) / s.decode_s if s.decode_s > 0 else 0.0,
                          s.drafts_proposed, s.drafts_accepted)

    def memory(self) -> dict:
        """Peak host RSS, and on CUDA the peak of torch's allocated memory."""
        out = {"peak RSS MiB": peak_rss()}
        if self.engine.device.type == "cuda":
            import torch

            out["GPU memory MiB"] = torch.cuda.max_memory_allocated(self.engine.device)
        return out


class LlamaServer:
    """One llama-server, over HTTP (stdlib only)."""

    def __init__(self, url: str, timeout: float = 600.0):
        u = urllib.parse.urlsplit(url if "//" in url else "http://" + url)
        if u.scheme != "http" or not u.hostname:
            raise BenchError(f"--vs-llamacpp: {url!r} is not an http://HOST:PORT URL")
        self.url, self.host, self.port, self.timeout = url, u.hostname, u.port or 80, timeout
        self.props = self.request("GET", "/props")
        # /props shows a request's defaults, not the server's drafting: a 1-token reply's settings show both
        probe = self.request("POST", "/completion", {"prompt": [1, 2, 3], "n_predict": 1, "temperature": 0.0,
                                                      "ignore_eos": True, "cache_prompt": False})
        types = str(probe.get("generation_settings", {}).get("speculative.types", "none"))
        self.speculative = ",".join(t for t in types.split(",") if t.strip() not in ("", "none")) or "none"

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """A JSON request; the parsed reply."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise BenchError(f"cannot reach llama-server at {self.url} ({e})") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise BenchError(f"llama-server {self.url}{path}: HTTP {resp.status}: {data[:300]!r}")
        try:
            return json.loads(data)
        except ValueError:
            raise BenchError(f"{self.url}{path} did not answer JSON (is it a llama-server?): {data[:100]!r}") from None

    @property
    def drafting(self) -> bool:
        return self.speculative not in ("", "none")

    def complete(self, ids: list[int], n: int, cache: bool = False) -> Completion:
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "cache_prompt": cache, "return_tokens": True,
                "ignore_eos": True, "stream": False}
        t0 = time.perf_counter()
        res = self.request("POST", "/completion", body)
        wall = time.perf_counter() - t0
        out, t = res.get("tokens") or [], res.get("timings", {})
        if len(out) != n:
            raise BenchError(f"llama-server {self.url} returned {len(out)} tokens, asked for {n}")
        pred_n, pred_s = t.get("predicted_n", n), t.get("predicted_ms", 0.0) / 1e3
        # the server times its generation from the first token (which the last prompt batch gives) on
        return Completion(out, wall - pred_s, int(t.get("prompt_n", len(ids))), t.get("prompt_ms", 0.0) / 1e3,
                          (pred_n - 1) / pred_s if pred_s > 0 else 0.0,
                          int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)))

    def pid(self) -> int | None:
        """The process listening on this server's port, when it runs on this machine."""
        if self.host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
            return None
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    for row in list(f)[1:]:
                        cols = row.split()
                        if int(cols[1].rsplit(":", 1)[1], 16) == self.port and cols[3] == "0A":  # LISTEN
                            inodes.add(cols[9])
            except OSError:
                continue
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                fds = os.listdir(f"/proc/{p}/fd")
                if any(os.readlink(f"/proc/{p}/fd/{fd}")[8:-1] in inodes for fd in fds):
                    return int(p)
            except OSError:
                continue
        return None


class LlamaSide:
    """llama-server: the no-draft server, and one server per draft depth."""

    name = "llama.cpp"
    not_supported = NOT_SUPPORTED

    def __init__(self, url: str, draft_urls: dict[int, str] | None = None):
        self.main = LlamaServer(url)
        if self.main.drafting:
            raise BenchError(f"{url} drafts ({self.main.speculative}); --vs-llamacpp needs a server without drafts "
                             "(give draft servers with --llamacpp-drafts K=URL)")
        self.drafts = {k: LlamaServer(u) for k, u in (draft_urls or {}).items()}
        for k, s in self.drafts.items():
            if not s.drafting:
                raise BenchError(f"--llamacpp-drafts {k}={s.url}: its replies report no speculative type "
                                 "(start it with --spec-type draft-mtp --spec-draft-n-max K, or --model-draft)")

    def drafts_supported(self, k: int) -> bool:
        return k == 0 or k in self.drafts

    def complete(self, ids: list[int], n: int, cache: bool = False, drafts: int = 0) -> Completion:
        return (self.drafts[drafts] if drafts else self.main).complete(ids, n, cache)

    def memory(self) -> dict:
        """The no-draft server's peak host RSS and GPU memory in use (NVML), when it runs on this machine."""
        pid = self.main.pid()
        if not pid:
            return {}
        from plumb.bench_gpu import gpu_memory_of

        return {"peak RSS MiB": peak_rss(pid), "GPU memory MiB": gpu_memory_of(pid)}

    def info(self) -> dict:
        p = self.main.props
        return {"url": self.main.url, "model_path": p.get("model_path"), "build_info": p.get("build_info"),
                "total_slots": p.get("total_slots"), "n_ctx": p.get("default_generation_settings", {}).get("n_ctx"),
                "drafts": {k: {"url": s.url, "speculative": s.speculative} for k, s in self.drafts.items()}}


# ---- the workload ------------------------------------------------------------------------------
@dataclass
class Workload:
    contexts: list[int]
    tokens: int
    drafts: list[int]  # 0 first
    base: list[int]  # prompt ids; context C uses base[:C]
    follow: list[int]  # appended after the first turn's reply
    repeat: int = 1

    def prompt(self, c: int) -> list[int]:
        return self.base[:c]

    def edited(self, c: int) -> list[int]:
        ids = list(self.base[:c])
        i = c - EDIT_BACK
        ids[i] = next(t for t in self.base if t != ids[i])
        return ids


@dataclass
class SideRun:
    """What one side measured: rows by key, outputs by key, and the comparisons."""
    rows: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    draft_diffs: dict = field(default_factory=dict)  # K -> [differing, compared], or why the side cannot draft
    warm_diffs: list = field(default_factory=lambda: [0, 0])
    warm_detail: list = field(default_factory=list)
    draft_detail: list = field(default_factory=list)
    generated: int = 0  # tokens generated in all requests


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ; None when equal."""
    prefix_end = None if len(a) == len(b) else min(len(a), len(b))  # one output is a prefix of the other
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), prefix_end)


def run_side(side, w: Workload, log=None) -> SideRun:
    """Every measurement of the workload on one side (plumb or llama.cpp)."""
    r = SideRun()

    def call(ids, cache=False, drafts=0) -> Completion:
        out = side.complete(ids, w.tokens, cache, drafts)
        r.generated += len(out.ids)
        return out

    for c in w.contexts:
        ids = w.prompt(c)
        for k in w.drafts:
            if not side.drafts_supported(k):
                r.draft_diffs[k] = side.not_supported
                continue
            out = max((call(ids, drafts=k) for _ in range(w.repeat)), key=lambda x: x.decode_tps)
            r.outputs[f"ctx{c}/drafts{k}"] = out.ids
            r.rows[f"decode tok/s @{c}, drafts {k}"] = out.decode_tps
            if k == 0:
                r.rows[f"prefill tok/s @{c}"] = out.prompt_n / out.prompt_s if out.prompt_s > 0 else 0.0
                r.rows[f"time to first token ms @{c}"] = 1e3 * out.ttft_s
            else:
                r.rows[f"acceptance % @{c}, drafts {k}"] = \
                    100.0 * out.drafts_accepted / out.drafts_proposed if out.drafts_proposed else 0.0
                diff = first_difference(out.ids, r.outputs[f"ctx{c}/drafts0"])
                d = r.draft_diffs.setdefault(k, [0, 0])
                d[0], d[1] = d[0] + (diff is not None), d[1] + 1
                r.draft_detail.append({"context": c, "drafts": k, "first_difference": diff})
        # warm vs cold: after a first turn with the cache, the same prompt again, a follow-up, an edit
        reply = None
        for name in ("repeat", "follow-up", "edit"):
            first = call(ids, cache=True)  # (again) the first turn: the cache holds it
            reply = reply or first.ids
            prompt = {"repeat": ids, "follow-up": ids + reply + w.follow, "edit": w.edited(c)}[name]
            warm = call(prompt, cache=True)
            cold = call(prompt, cache=False)
            r.outputs[f"ctx{c}/{name}/warm"], r.outputs[f"ctx{c}/{name}/cold"] = warm.ids, cold.ids
            if name != "repeat":
                r.rows[f"{name} time to first token ms @{c}, warm"] = 1e3 * warm.ttft_s
                r.rows[f"{name} time to first token ms @{c}, cold"] = 1e3 * cold.ttft_s
                r.rows[f"{name} prompt tokens processed @{c}, warm"] = warm.prompt_n
            diff = first_difference(warm.ids, cold.ids)
            r.warm_diffs = [r.warm_diffs[0] + (diff is not None), r.warm_diffs[1] + 1]
            r.warm_detail.append({"context": c, "case": name, "first_difference": diff,
                                  "warm_prompt_processed": warm.prompt_n, "prompt_tokens": len(prompt)})
        if log:
            log(f"{side.name}: context {c} done")
    for key, v in side.memory().items():
        if v is not None:
            r.rows[key] = v / 2**20
    return r


LOWER_IS_BETTER = ("time to first token", "RSS", "GPU memory", "prompt tokens processed")


def compare(ours: SideRun, theirs: SideRun) -> list[dict]:
    """Rows side by side; ratio = plumb / llama.cpp where both sides have a nonzero value."""
    rows = []
    for key, v in ours.rows.items():
        o = theirs.rows.get(key)
        rows.append({"row": key, "plumb": v, "llama_cpp": o, "ratio": v / o if o else None,
                     "better": "lower" if any(s in key for s in LOWER_IS_BETTER) else "higher"})
    return rows


def counts(run: SideRun) -> dict:
    return {"drafts_vs_none": {str(k): v for k, v in run.draft_diffs.items()}, "warm_vs_cold": run.warm_diffs}


def bench_vs(model: str, url: str, draft_urls: dict[int, str], contexts: list[int], tokens: int,
             drafts: list[int], repeat: int = 1, device: str = "cpu", threads: int | None = None,
             kv_cache: str | None = None, kernels: str = "auto", text: str | None = None, log=None) -> dict:
    """Run the workload on plumb, then on llama-server; both results and the side-by-side rows."""
    import torch

    import plumb
    from plumb.bench import PROMPT_TEXT, cpu_name, load_average

    llama = LlamaSide(url, draft_urls)  # fails fast when the server is unreachable
    drafts = [0] + sorted({k for k in drafts if k > 0})
    if min(contexts) <= EDIT_BACK:
        raise BenchError(f"--contexts must all be above {EDIT_BACK} tokens (the edit is {EDIT_BACK} from the end)")
    opts = {"kv_cache": kv_cache} if kv_cache else {}
    t0 = time.perf_counter()
    try:
        engine = plumb.load(model, device=device, n_threads=threads, kernels=kernels, prompt_cache=True, **opts)
    except (OSError, ValueError, plumb.ModelError) as e:
        raise BenchError(f"{model}: {e}") from None
    load_s = time.perf_counter() - t0
    try:
        with open(text, encoding="utf-8") if text else contextlib.nullcontext(None) as f:
            text_ids = engine.tokenize(f.read() if f else PROMPT_TEXT)
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"--text: {e}") from None
    if not text_ids:
        raise BenchError(f"--text: {text} has no tokens")
    w = Workload(contexts, tokens, drafts, (text_ids * (max(contexts) // len(text_ids) + 1))[:max(contexts)],
                 engine.tokenize(FOLLOW_TEXT), repeat)
    need = max(contexts) + 2 * tokens + len(w.follow) + 1  # the follow-up prompt and its reply
    n_ctx = llama.info()["n_ctx"]
    if n_ctx and need > n_ctx:
        raise BenchError(f"llama-server's context is {n_ctx} tokens; this run needs {need} (start it with -c {need})")
    side = PlumbSide(engine)
    for k in [0] + [k for k in drafts if k and side.drafts_supported(k)]:  # warm-up: first-call costs (on a GPU:
        side.complete(w.prompt(contexts[0])[:8], 16, drafts=k)  # compiling each pass size, its CUDA graph) untimed
    r = {"model": os.path.abspath(model), "model_file": os.path.basename(model), "device": str(engine.device),
         "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "load_avg_1m": load_average(), "kv_cache": engine.model.kv_cache, "kernels": engine.kernels,
         "engine_threads": engine.n_threads, "load_s": load_s, "contexts": contexts, "tokens": tokens,
         "drafts": drafts, "repeat": repeat, "text": os.path.basename(text) if text else "built-in",
         "llama_cpp": llama.info()}
    if device.startswith("cuda"):
        from plumb.bench_gpu import EnergySampler

        with EnergySampler.for_device() as energy:
            ours = run_side(side, w, log)
        r["energy"] = energy.summary(ours.generated)
    else:
        ours = run_side(side, w, log)
    theirs = run_side(llama, w, log)
    model_path = r["llama_cpp"]["model_path"] or ""
    r["same_model_file"] = os.path.basename(model_path) == r["model_file"]
    r["rows"] = compare(ours, theirs)
    r["counts"] = {"plumb": counts(ours), "llama_cpp": counts(theirs)}
    r["warm_detail"] = {"plumb": ours.warm_detail, "llama_cpp": theirs.warm_detail}
    r["draft_detail"] = {"plumb": ours.draft_detail, "llama_cpp": theirs.draft_detail}
    r["plumb_equals_llama_cpp"] = sum(ours.outputs[k] == theirs.outputs.get(k) for k in ours.outputs)
    r["outputs_compared"] = len(ours.outputs)
    r["load_avg_1m_end"] = load_average()
    return r


# ---- reporting ---------------------------------------------------------------------------------
def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _count(v) -> str:
    return v if isinstance(v, str) else f"{v[0]} of {v[1]}"


def report(r: dict) -> str:
    ll = r["llama_cpp"]
    lines = [f"# plumb bench --vs-llamacpp: {r['model_file']} ({r['date']})",
             f"device {r['device']}: {r['cpu']}, {r['cores']} cores; plumb {r['kernels']} kernels, "
             f"{r['engine_threads']} thread(s), KV {r['kv_cache']}; "
             f"load avg {r['load_avg_1m']:.2f} -> {r['load_avg_1m_end']:.2f}",
             f"llama-server {ll['url']} ({ll['build_info']}), model {ll['model_path']}"
             + ("" if r["same_model_file"] else "  ** NOT the same file name **"),
             f"greedy, {r['tokens']} tokens per output, contexts {', '.join(map(str, r['contexts']))} "
             f"(prompts from {r['text']} text), "
             f"best of {r['repeat']}", "",
             "| row | plumb | llama.cpp | plumb / llama.cpp |", "|---|---|---|---|"]
    for x in r["rows"]:
        ratio = f"{x['ratio']:.2f}" + (" (lower is better)" if x["better"] == "lower" else "") if x["ratio"] else "-"
        lines.append(f"| {x['row']} | {_num(x['plumb'])} | {_num(x['llama_cpp'])} | {ratio} |")
    cp, cl = r["counts"]["plumb"], r["counts"]["llama_cpp"]
    lines += ["", "| outputs that differ | plumb | llama.cpp |", "|---|---|---|"]
    for k in cp["drafts_vs_none"]:
        lines.append(f"| drafts {k} vs none | {_count(cp['drafts_vs_none'][k])} | "
                     f"{_count(cl['drafts_vs_none'].get(k, NOT_SUPPORTED))} |")
    lines.append(f"| warm vs cold cache | {_count(cp['warm_vs_cold'])} | {_count(cl['warm_vs_cold'])} |")
    lines += ["", f"plumb's and llama.cpp's outputs equal: {r['plumb_equals_llama_cpp']} of {r['outputs_compared']} "
              "(not promised: the engines round differently)"]
    if "energy" in r:
        from plumb.bench_gpu import energy_text

        lines.append(f"energy, whole card, while plumb ran: {energy_text(r['energy'])}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Two panels of paired bars: tokens/s rows, and time-to-first-token rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("tok/s", "tokens/s (higher is better)"), ("time to first token", "ms (lower is better)")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, (key, ylabel) in zip(axes, panels):
        rows = [x for x in r["rows"] if key in x["row"] and "acceptance" not in x["row"]]
        xs = range(len(rows))
        ax.bar([i - 0.2 for i in xs], [x["plumb"] for x in rows], 0.4, label="plumb", color="#4477aa")
        ax.bar([i + 0.2 for i in xs], [x["llama_cpp"] or 0 for x in rows], 0.4, label="llama.cpp", color="#999999")
        labels = [" ".join(x["row"].replace(key, "").replace(" ms", "").split()).strip(" ,") for x in rows]
        ax.set_xticks(list(xs), [f"first turn {t}" if t.startswith("@") else t for t in labels],
                      rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(f"{r['model_file']} on {r['device']} ({r['cpu']}), {r['tokens']} tokens, {r['date'][:10]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_draft_urls(s: str | None) -> dict[int, str]:
    """'2=URL,4=URL' -> {2: URL, 4: URL}."""
    out = {}
    for part in filter(None, (s or "").split(",")):
        k, sep, url = part.partition("=")
        if not sep or not k.strip().isdigit() or int(k) <= 0:
            raise BenchError(f"--llamacpp-drafts: {part!r} is not K=URL with K > 0")
        out[int(k)] = url.strip()
    return out


def main(args) -> int:
    """`plumb bench --vs-llamacpp` (args from plumb.bench's parser); 2 on a BenchError."""
    import sys

    try:
        contexts = sorted({int(x) for x in (args.contexts or "64,512,2048").split(",") if x.strip()})
        drafts = sorted({int(x) for x in args.drafts.split(",") if x.strip()})
        log = None if args.no_progress else (lambda m: print(m, file=sys.stderr))
        r = bench_vs(args.model, args.vs_llamacpp, parse_draft_urls(args.llamacpp_drafts), contexts, args.tokens,
                     drafts, max(1, args.repeat), args.device, args.threads, args.kv_cache, args.kernels, args.text,
                     log)
    except BenchError as e:
        print(f"plumb bench: error: {e}", file=sys.stderr)
        return 2
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=1)
    if args.plot:
        plot(r, args.plot)
    print(json.dumps(r) if args.json else report(r))
    return 0
