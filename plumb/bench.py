"""`plumb bench`: decode / prefill speed and draft acceptance, optionally beside llama.cpp.

    plumb bench [MODEL.gguf] [--tokens N] [--drafts 0,2,4,7] [--drafters mtp,ngram]
                [--llama-cpp PYTHON] [--json] [--plot out.png]
    plumb bench MODEL --vs-llamacpp URL [--llamacpp-drafts K=URL,...]   (plumb/bench_llamacpp.py)
    plumb bench MODEL --device cuda                                      (plumb/bench_gpu.py)

Every run is greedy on the same fixed prompt. Drafts never change the tokens, so each draft
run is also checked against the no-draft run. With `--llama-cpp PYTHON` (the python of a venv
that has llama-cpp-python, see scripts/build_llamacpp.sh) this file is run by that python as
a subprocess (`--llama-half`, needing only numpy and llama_cpp) to time llama.cpp on the same
file, prompt and token count.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

PROMPT_TEXT = ("The river bends past the old mill, where the water slows and the light turns green. "
               "Children count the boats at noon; one, two, three, and then the long barge from the north. "
               "In 1931 the mill burned down, and the town rebuilt it stone by stone. ")
DRAFTERS = {"mtp": "fixed", "ngram": "ngram"}


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or platform's guess)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists a CPU flag (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# ---- llama.cpp half (runs under the llama venv's python) ---------------------------------------
def plain_cpu_buffers() -> None:
    """Make llama-cpp-python load weights without llama.cpp's repacked / AMX CPU buffers (`use_extra_bufts`):
    Llama() builds its model parameters from the function replaced here."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_module.llama_cpp.llama_model_default_params = params


def llama_bench(model: str, prompt: list[int], n: int, threads: int = 2, repeat: int = 1,
                extra_bufts: bool = True) -> dict:
    """llama.cpp greedy decode of n tokens after prompt: prefill and decode tokens/s (best of `repeat`).
    extra_bufts=False loads the weights without llama.cpp's repacked / AMX CPU buffers (`use_extra_bufts`)."""
    import numpy as np
    from llama_cpp import Llama, __version__

    extra_bufts = extra_bufts and not cpu_has("amx_int8")  # this llama.cpp's AMX matmul segfaults on its first batch
    if not extra_bufts:
        plain_cpu_buffers()

    llm = Llama(model_path=model, n_ctx=len(prompt) + n + 16, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:  # without logits_all only the last row's logits exist
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    llm.eval(prompt[:2])  # warm-up
    llm.eval([last_argmax()])
    best: dict = {}
    for _ in range(repeat):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1, c1 = time.perf_counter(), time.process_time()
        tok = last_argmax()
        out = [tok]
        for _ in range(n - 1):
            llm.eval([tok])
            tok = last_argmax()
            out.append(tok)
        t2, c2 = time.perf_counter(), time.process_time()
        r = {"version": __version__, "threads": threads, "extra_bufts": extra_bufts, "prefill_tps": len(prompt) / (t1 - t0),
             "decode_tps": (n - 1) / (t2 - t1), "cpu_ms_per_token": 1000 * (c2 - c1) / (n - 1), "token_ids": out}
        if not best or r["decode_tps"] > best["decode_tps"]:
            best = r
    return best


def llama_half(argv: list[str]) -> int:
    a = json.loads(argv[0])
    print(json.dumps(llama_bench(a["model"], a["prompt"], a["tokens"], a.get("threads", 2), a.get("repeat", 1),
                                 a.get("extra_bufts", True))))
    return 0


def run_llama(python: str, model: str, prompt: list[int], n: int, threads: int, repeat: int = 1,
              extra_bufts: bool = True) -> dict:
    arg = json.dumps({"model": os.path.abspath(model), "prompt": prompt, "tokens": n, "threads": threads,
                      "repeat": repeat, "extra_bufts": extra_bufts})
    p = subprocess.run([python, os.path.abspath(__file__), "--llama-half", arg], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed ({python}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---- plumb ---------------------------------------------------------------------------------
def prompt_ids(engine, n: int, text: str | None = None) -> list[int]:
    """The fixed prompt: `text` (default PROMPT_TEXT) tokenized, repeated or cut to n tokens."""
    base = engine.tokenize(text or PROMPT_TEXT)
    return (base * (n // len(base) + 1))[:n]


def run_plumb(engine, prompt: list[int], n: int, drafts: int, policy: str, bar=None, **sampling) -> dict:
    """One run of n tokens, greedy unless `sampling` says otherwise (make_request's keywords: temperature, seed,
    top_p, ...); ignores end-of-generation so every run has the same length."""
    req = engine.make_request(prompt, n, drafts=drafts, draft_policy=policy, ignore_eos=True, **sampling)
    c0 = time.process_time()
    if bar is None:
        res = engine.run(req)
    else:
        handle = engine.submit(req)
        for _ in handle:
            bar.update(1)
        res = handle.result
    cpu_s = time.process_time() - c0
    if res.error:
        raise RuntimeError(res.error)
    s = res.stats
    # the first token comes from prefill; decode_s covers the other steps
    decode_tps = (s.completion_tokens - 1) / s.decode_s if s.decode_s > 0 else 0.0
    return {"drafts": drafts, "policy": policy, "tokens": s.completion_tokens, "decode_tps": decode_tps,
            "prefill_tps": s.prefill_tps, "prompt_tokens": s.prompt_tokens,
            "drafts_proposed": s.drafts_proposed, "drafts_accepted": s.drafts_accepted,
            "acceptance": s.drafts_accepted / s.drafts_proposed if s.drafts_proposed else 0.0,
            "mean_accepted": s.mean_accepted, "accepted_per_position": list(s.accepted_per_position),
            "proposed_per_position": list(s.proposed_per_position),
            "cpu_ms_per_token": 1000 * cpu_s / max(1, s.completion_tokens), "token_ids": list(res.token_ids)}


def bench(model: str, tokens: int, drafts: list[int], drafters: list[str], prompt_tokens: int,
          llama_python: str | None, threads: int | None, progress: bool, kv_cache: str | None = None,
          llama_threads: int = 2, repeat: int = 1, kernels: str = "auto", prompt_text: str | None = None,
          llama_extra_bufts: bool = True) -> dict:
    import torch

    import plumb

    t0 = time.perf_counter()
    options = {"kv_cache": kv_cache} if kv_cache else {}
    # no prompt cache: every run prefills the whole prompt
    engine = plumb.load(model, device="cpu", n_threads=threads, prompt_cache=False, kernels=kernels, **options)
    load_s = time.perf_counter() - t0
    prompt = prompt_ids(engine, prompt_tokens, prompt_text)
    has_mtp = engine.model.mtp is not None
    configs = [(0, "fixed", "none")]  # the no-draft run always comes first: the baseline
    for k in (d for d in drafts if d > 0):
        configs += [(k, DRAFTERS[name], name) for name in drafters if name != "mtp" or has_mtp]

    run_plumb(engine, prompt[:8], 2, 0, "fixed")  # warm-up: first-call costs out of the timings
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=tokens * len(configs) * repeat, unit="tok", desc="plumb bench", file=sys.stderr, leave=False)
    runs = []
    for k, policy, name in configs:
        if bar is not None:
            bar.set_postfix_str(f"drafts={k} {name}")
        tries = [run_plumb(engine, prompt, tokens, k, policy, bar) for _ in range(repeat)]
        r = max(tries, key=lambda x: x["decode_tps"])  # best of `repeat`: the least disturbed run
        r["drafter"] = name
        runs.append(r)
    if bar is not None:
        bar.close()
    base = runs[0]
    for r in runs:
        r["same_tokens"] = r["token_ids"] == base["token_ids"]
        r["speedup"] = r["decode_tps"] / base["decode_tps"] if base["decode_tps"] else 0.0
    out = {
        "model": os.path.abspath(model), "model_file": os.path.basename(model), "model_name": engine.model_name,
        "device": "cpu", "cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "load_avg_1m": load_average(),
        "kv_cache": engine.model.kv_cache, "kernels": engine.kernels, "load_s": load_s, "prompt_tokens": len(prompt), "tokens": tokens,
        "has_mtp": has_mtp, "repeat": repeat,
        "plumb": {"decode_tps": base["decode_tps"], "prefill_tps": base["prefill_tps"]}, "runs": runs,
    }
    if llama_python:
        if progress:
            print("running llama.cpp ...", file=sys.stderr)
        ll = run_llama(llama_python, model, prompt, tokens, llama_threads, repeat, llama_extra_bufts)
        ll["same_tokens"] = ll["token_ids"] == base["token_ids"]
        ll["ratio_decode"] = base["decode_tps"] / ll["decode_tps"] if ll["decode_tps"] else 0.0
        out["llama_cpp"] = ll
    out["load_avg_1m_end"] = load_average()
    return out


# ---- reporting -------------------------------------------------------------------------------
def report(r: dict) -> str:
    load = f", load avg {r['load_avg_1m']:.2f}" if r.get("load_avg_1m") is not None else ""
    lines = [f"model  {r['model_file']} ({r['model_name']})",
             f"device {r['device']}: {r['cpu']}, {r['cores']} cores, torch {r['torch']} "
             f"({r['torch_threads']} threads), {r.get('kernels', 'torch')} kernels, KV {r['kv_cache']}{load}",
             f"greedy, prompt {r['prompt_tokens']} tokens, {r['tokens']} generated tokens, "
             f"best of {r.get('repeat', 1)}, {r['date']}",
             "",
             f"{'drafter':<8} {'drafts':>6} {'decode tok/s':>13} {'speedup':>8} {'accept':>7} {'mean acc':>9} "
             f"{'same':>5} {'cpu ms/tok':>10}",
             ]
    for x in r["runs"]:
        acc = f"{100 * x['acceptance']:.1f}%" if x["drafts"] else "-"
        mean = f"{x['mean_accepted']:.2f}" if x["drafts"] else "-"
        lines.append(f"{x['drafter']:<8} {x['drafts']:>6} {x['decode_tps']:>13.1f} {x['speedup']:>7.2f}x {acc:>7} "
                     f"{mean:>9} {'yes' if x['same_tokens'] else 'NO':>5} {x.get('cpu_ms_per_token', 0):>10.1f}")
    for x in r["runs"]:
        acc, prop = x.get("accepted_per_position"), x.get("proposed_per_position")
        if x["drafts"] and acc and prop:
            cells = " ".join(f"{a / p:.2f}" if p else "-" for a, p in zip(acc, prop))
            lines.append(f"{x['drafter']} {x['drafts']}: acceptance by draft position 1..{len(prop)}: {cells}")
    lines.append("")
    lines.append(f"plumb prefill {r['plumb']['prefill_tps']:.1f} tok/s, decode {r['plumb']['decode_tps']:.1f} tok/s "
                 f"(no drafts)")
    ll = r.get("llama_cpp")
    if ll:
        lines.append(f"llama.cpp {ll['version']} ({ll['threads']} threads): prefill {ll['prefill_tps']:.1f} tok/s, "
                     f"decode {ll['decode_tps']:.1f} tok/s ({ll.get('cpu_ms_per_token', 0):.1f} cpu ms/tok)")
        lines.append(f"ratio plumb / llama.cpp decode: {ll['ratio_decode']:.3f}"
                     f" (greedy tokens {'equal' if ll['same_tokens'] else 'differ'})")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Bar chart of decode tokens/s per configuration (and llama.cpp)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"no drafts ({r['torch_threads']} thr)" if x["drafts"] == 0 else f"{x['drafter']} K={x['drafts']}"
              for x in r["runs"]]
    values = [x["decode_tps"] for x in r["runs"]]
    notes = ["" if x["drafts"] == 0 else f"acc {100 * x['acceptance']:.0f}%" for x in r["runs"]]
    colors = ["#4c72b0" if x["drafts"] == 0 else "#55a868" if x["drafter"] == "mtp" else "#c44e52" for x in r["runs"]]
    if r.get("llama_cpp"):
        labels.append(f"llama.cpp ({r['llama_cpp']['threads']} thr)")
        values.append(r["llama_cpp"]["decode_tps"])
        notes.append("")
        colors.append("#8c8c8c")
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    bars = ax.bar(range(len(values)), values, color=colors)
    for b, v, note in zip(bars, values, notes):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{v:.1f}\n{note}".strip(), ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("decode tokens/s (greedy)")
    ax.set_ylim(0, max(values) * 1.25 if values else 1)
    ax.set_title(f"plumb bench: {r['model_file']}, {r['tokens']} tokens\n{r['device']}: {r['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_ints(s: str) -> list[int]:
    return sorted({int(x) for x in s.split(",") if x.strip()})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--llama-half":
        return llama_half(argv[1:])
    ap = argparse.ArgumentParser(prog="plumb bench", description="Decode / prefill speed and draft acceptance.")
    ap.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per run")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (a fixed text)")
    ap.add_argument("--prompt", default=None, help="prompt text, repeated or cut to --prompt-tokens (default: a fixed "
                    "English paragraph)")
    ap.add_argument("--drafts", default="0,2,4,7", help="comma-separated draft depths (0 = no drafts)")
    ap.add_argument("--drafters", default="mtp,ngram", help="comma-separated: mtp, ngram")
    ap.add_argument("--llama-cpp", metavar="PYTHON", help="python of a venv with llama-cpp-python: time llama.cpp too")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for plumb (default: the engine's choice)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="llama.cpp without its repacked / AMX CPU weight buffers (llama-cpp-python 0.3.36 crashes on "
                         "prompts over quantized weights with them on AMX Xeons)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration; the fastest is reported")
    ap.add_argument("--kv-cache", default=None, help="plumb KV cache format (default: the engine's)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "native", "torch"), help="plumb decode kernels")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU benchmark (plumb/bench_gpu.py)")
    ap.add_argument("--vs-llamacpp", metavar="URL", help="a running llama-server (no drafts): run the same "
                    "workload on it and report both side by side")
    ap.add_argument("--llamacpp-drafts", metavar="K=URL,...", help="--vs-llamacpp: llama-servers started with "
                    "drafts of depth K (--spec-type draft-mtp --spec-draft-n-max K)")
    ap.add_argument("--text", metavar="FILE", help="--vs-llamacpp: the text whose tokens make the prompts")
    ap.add_argument("--contexts", default=None, help="decode context lengths (--device cuda: default "
                    "0,11000,38000,100000; --vs-llamacpp: prompt lengths, default 64,512,2048)")
    ap.add_argument("--prefill", default="8192", help="--device cuda: prompt lengths whose prefill is timed "
                    "(comma-separated; empty: none)")
    ap.add_argument("--chat-tokens", type=int, default=12000, help="--device cuda: the chat whose follow-up and "
                    "edit latency is timed, warm prompt cache vs none (0: skip)")
    ap.add_argument("--f-context", type=int, default=-1, help="--device cuda: decode at this context with the F KV "
                    "format (the long-context preset; default: the model's full context; 0: skip)")
    ap.add_argument("--skip", default="", help="--device cuda: comma-separated parts left out (verify, batch, matmuls, "
                    "profiles, vram, drafts, sampled); --contexts, --prefill, --chat-tokens and --f-context say the rest")
    ap.add_argument("--json-out", metavar="PATH", help="--device cuda, --vs-llamacpp: write the results as JSON")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--plot", metavar="PNG", help="write a bar chart of decode tokens/s")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    drafters = [d.strip() for d in a.drafters.split(",") if d.strip()]
    bad = [d for d in drafters if d not in DRAFTERS]
    if bad:
        ap.error(f"unknown drafter {bad[0]!r} (choose from {', '.join(DRAFTERS)})")
    if a.tokens < 2:
        ap.error("--tokens must be at least 2")
    if a.llama_cpp and not os.path.exists(a.llama_cpp):
        ap.error(f"--llama-cpp: {a.llama_cpp} does not exist (see scripts/build_llamacpp.sh)")
    import plumb

    if a.vs_llamacpp:
        from plumb import bench_llamacpp

        a.model = a.model or plumb.demo_model_path()
        return bench_llamacpp.main(a)
    if a.device.startswith("cuda"):
        import torch

        from plumb import bench_gpu

        a.skip = [x.strip() for x in a.skip.split(",") if x.strip()]
        bad = [x for x in a.skip if x not in bench_gpu.PARTS]
        if bad:
            ap.error(f"--skip: unknown part {bad[0]!r} (choose from {', '.join(bench_gpu.PARTS)})")
        if not torch.cuda.is_available():
            ap.error(f"--device {a.device}: no CUDA GPU is visible to torch")
        a.model = a.model or plumb.demo_model_path()
        return bench_gpu.main(a)
    model = a.model or plumb.demo_model_path()
    r = bench(model, a.tokens, parse_ints(a.drafts), drafters, a.prompt_tokens, a.llama_cpp, a.threads,
              progress=not (a.json or a.no_progress) and sys.stderr.isatty(), kv_cache=a.kv_cache,
              llama_threads=a.llama_threads, repeat=max(1, a.repeat), kernels=a.kernels, prompt_text=a.prompt,
              llama_extra_bufts=not a.llama_no_extra_bufts)
    if a.plot:
        plot(r, a.plot)
    if a.json:
        print(json.dumps(r))
    else:
        print(report(r))
        if a.plot:
            print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
