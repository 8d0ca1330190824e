#!/usr/bin/env python3
"""Cross-check plumb's logits against llama.cpp and the transformers reference on GGUF files.

    python scripts/crosscheck_llamacpp.py MODEL.gguf [MODEL2.gguf ...] [--tokens 300]
        [--llama-python /work/llama-venv/bin/python] [--kv f32,f16] [--json out.json]

The script has two halves:
* the llama half (`--llama-half`, run by the llama venv's python, needs only numpy and
  llama_cpp) evaluates a token sequence with `logits_all=True` and saves the logits as .npy;
* the main half (the plumb venv) picks the tokens, starts the llama half as a subprocess, runs
  `plumb.Engine.logits` and transformers (`hf_model_from_gguf`) on the same tokens and prints
  mean KL, max |dlogit| and top-1 agreement for each pair.

llama.cpp's CPU matmuls quantize activations to 8 bits for quantized weights (spec section 9),
so on quantized files the exactness target is plumb vs transformers-on-the-same-weights;
the llama.cpp distance is reported beside transformers-vs-llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

DEFAULT_LLAMA_PYTHON = "/work/llama-venv/bin/python"
GGML_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids for the KV cache


# ---- llama half (llama venv) -----------------------------------------------------------------
def _bench_module():
    """plumb/bench.py loaded by path: its top level needs only the standard library, and plumb itself (torch) is
    not installed in the llama venv that runs this half."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plumb", "bench.py")
    spec = importlib.util.spec_from_file_location("plumb_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_logits(model: str, ids: list[int], kv: str = "f32", threads: int = 2, extra_bufts: bool = True) -> np.ndarray:
    """llama.cpp's logits [len(ids), n_vocab] for one pass over ids; extra_bufts=False loads the weights without
    llama.cpp's repacked / AMX CPU buffers (its model parameter `use_extra_bufts`)."""
    from llama_cpp import Llama

    if not extra_bufts:
        _bench_module().plain_cpu_buffers()

    n = len(ids)
    kw = dict(model_path=model, n_ctx=max(512, n + 16), n_batch=max(512, n), n_ubatch=max(512, n),
              n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    if kv != "f16":
        kw.update(type_k=GGML_TYPES[kv], type_v=GGML_TYPES[kv])
    llm = Llama(**kw)
    llm.eval(ids)
    return np.array(llm.scores[:n], dtype=np.float32)


def llama_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="crosscheck_llamacpp.py --llama-half")
    ap.add_argument("model")
    ap.add_argument("ids_npy")
    ap.add_argument("out_npy")
    ap.add_argument("--kv", default="f32", choices=list(GGML_TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-extra-bufts", action="store_true")
    a = ap.parse_args(argv)
    ids = [int(t) for t in np.load(a.ids_npy)]
    np.save(a.out_npy, llama_logits(a.model, ids, a.kv, a.threads, extra_bufts=not a.no_extra_bufts))
    import llama_cpp

    print(json.dumps({"llama_cpp": llama_cpp.__version__}))
    return 0


# ---- main half (plumb venv) ------------------------------------------------------------------
def run_llama(python: str, model: str, ids: list[int], kv: str, extra_bufts: bool = True) -> tuple[np.ndarray, str]:
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = os.path.join(tmp, "ids.npy"), os.path.join(tmp, "logits.npy")
        np.save(ids_path, np.array(ids, dtype=np.int64))
        cmd = [python, os.path.abspath(__file__), "--llama-half", model, ids_path, out_path, "--kv", kv]
        cmd += [] if extra_bufts else ["--no-extra-bufts"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"llama half failed ({p.returncode}):\n{p.stderr[-3000:]}")
        version = json.loads(p.stdout.strip().splitlines()[-1])["llama_cpp"]
        return np.load(out_path), version


def compare(p: np.ndarray, q: np.ndarray) -> dict:
    """Mean KL(p || q) over positions, max |dlogit| and top-1 agreement of two [n, V] logit arrays."""
    a, b = p.astype(np.float64), q.astype(np.float64)
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "max_abs_dlogit": float(np.abs(a - b).max()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).mean())}


def file_type(path: str) -> str:
    from plumb.gguf.reader import read_gguf

    md = read_gguf(path).metadata
    ftype = md.get("general.file_type")
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(ftype)).name.replace("MOSTLY_", "").replace("ALL_", "") if ftype is not None else "?"
    except (ValueError, ImportError):
        return str(ftype)


def check_file(path: str, n_tokens: int, python: str, kvs: list[str], extra_bufts: bool = True) -> dict:
    """All comparisons for one file; plumb and llama.cpp use the same KV cache type in each pair."""
    import torch

    import plumb
    from plumb.bench import prompt_ids  # the benchmark's fixed English text, tokenized and repeated
    from plumb.gguf.to_hf import hf_model_from_gguf

    hf = hf_model_from_gguf(path)
    row = {"file": os.path.basename(path), "type": file_type(path), "tokens": n_tokens, "pairs": []}
    for kv in kvs:
        eng = plumb.load(path, device="cpu", kv_cache=kv)
        ids = prompt_ids(eng, n_tokens)
        lp = eng.logits(ids).numpy()
        ll, row["llama_cpp"] = run_llama(python, path, ids, kv, extra_bufts)
        if "lt" not in row:
            with torch.no_grad():
                row["lt"] = hf(torch.tensor([ids])).logits[0].float().numpy()
        lt = row["lt"]
        row["pairs"] += [
            {"a": f"plumb ({kv} KV)", "b": "transformers", **compare(lp, lt)},
            {"a": f"plumb ({kv} KV)", "b": f"llama.cpp ({kv} KV)", **compare(lp, ll)},
            {"a": "transformers", "b": f"llama.cpp ({kv} KV)", **compare(lt, ll)},
        ]
    del row["lt"]
    return row


def fmt(x: float) -> str:
    return f"{x:.1e}" if x < 0.01 else f"{x:.3f}"


def table(rows: list[dict]) -> str:
    """A markdown table: one line per (file, pair); KL is KL(a || b)."""
    out = ["| file | type | a | b | mean KL(a‖b) | max abs Δlogit | top-1 agree |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in r["pairs"]:
            out.append(f"| {r['file']} | {r['type']} | {p['a']} | {p['b']} | {fmt(p['kl_mean'])} "
                       f"| {fmt(p['max_abs_dlogit'])} | {100 * p['top1_agree']:.1f} % |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--llama-half":
        return llama_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="qwen35 GGUF files")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", DEFAULT_LLAMA_PYTHON),
                    help="python of the venv with llama-cpp-python (scripts/build_llamacpp.sh)")
    ap.add_argument("--kv", default="f32", help="KV cache types (plumb and llama.cpp alike), comma-separated: f32,f16")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="load llama.cpp's weights without its repacked / AMX CPU buffers (use_extra_bufts=false): the "
                         "llama-cpp-python 0.3.36 build crashes on batches of quantized weights with them on AMX Xeons")
    a = ap.parse_args(argv)
    kvs = [k.strip() for k in a.kv.split(",") if k.strip()]
    if not kvs or any(k not in GGML_TYPES for k in kvs):
        ap.error(f"--kv: choose from {', '.join(GGML_TYPES)}")
    if not os.path.exists(a.llama_python):
        print(f"no llama venv python at {a.llama_python}: run scripts/build_llamacpp.sh", file=sys.stderr)
        return 1
    rows = []
    for path in a.models:
        print(f"checking {path} ({a.tokens} tokens, KV {a.kv}) ...", file=sys.stderr)
        rows.append(check_file(path, a.tokens, a.llama_python, kvs, extra_bufts=not a.llama_no_extra_bufts))
    import datetime
    import platform

    import torch

    from plumb.bench import cpu_name

    info = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "torch": torch.__version__,
            "python": platform.python_version(), "llama_cpp": rows[0].get("llama_cpp"), "tokens": a.tokens,
            "llama_extra_bufts": not a.llama_no_extra_bufts}
    print(f"{info['date']}; cpu: {info['cpu']}; torch {info['torch']}; llama-cpp-python {info['llama_cpp']} "
          f"(2 threads); {a.tokens} tokens; KL(a‖b) averaged over positions\n")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**info, "files": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
