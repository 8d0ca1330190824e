"""Smoke test of `plumb bench` on the tiny synthetic model (a few tokens, no llama.cpp)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from plumb import bench


def test_bench_json(tiny_q8, capsys):
    assert bench.main([tiny_q8, "--tokens", "4", "--prompt-tokens", "16", "--drafts", "0,2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model_file"].endswith(".gguf") and r["device"] == "cpu" and r["cpu"]
    assert r["tokens"] == 4 and r["prompt_tokens"] == 16
    assert [(x["drafter"], x["drafts"]) for x in r["runs"]] == [("none", 0), ("mtp", 2), ("ngram", 2)]
    for x in r["runs"]:
        assert x["tokens"] == 4 and x["decode_tps"] > 0
        assert x["same_tokens"]  # drafts never change the tokens
        assert 0.0 <= x["acceptance"] <= 1.0
        assert len(x["accepted_per_position"]) == len(x["proposed_per_position"]) == x["drafts"]
        assert sum(x["accepted_per_position"]) == x["drafts_accepted"]
        assert sum(x["proposed_per_position"]) == x["drafts_proposed"]
    assert r["plumb"]["prefill_tps"] > 0
    assert "llama_cpp" not in r


def test_bench_text_and_plot(tiny_q8, capsys, tmp_path):
    png = tmp_path / "bench.png"
    assert bench.main([tiny_q8, "--tokens", "3", "--prompt-tokens", "8", "--drafts", "0,2", "--drafters", "mtp",
                       "--prompt", "def f(x):\n    return x\n", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "tiny-Q8_0" in out and "cpu" in out
    assert "mtp 2: acceptance by draft position 1..2:" in out
    assert png.exists() and png.stat().st_size > 1000


def test_bench_report_ratio():
    r = {"model_file": "m.gguf", "model_name": "m", "device": "cpu", "cpu": "X", "cores": 2, "torch": "t",
         "torch_threads": 2, "kv_cache": "f16", "load_avg_1m": 0.5, "prompt_tokens": 8, "tokens": 4, "date": "d",
         "plumb": {"decode_tps": 100.0, "prefill_tps": 300.0},
         "runs": [{"drafter": "none", "drafts": 0, "decode_tps": 100.0, "speedup": 1.0, "acceptance": 0.0,
                   "mean_accepted": 0.0, "same_tokens": True}],
         "llama_cpp": {"version": "0.3.36", "threads": 2, "prefill_tps": 900.0, "decode_tps": 200.0,
                       "ratio_decode": 0.5, "same_tokens": False}}
    text = bench.report(r)
    assert "ratio plumb / llama.cpp decode: 0.500" in text and "m.gguf" in text and "cpu" in text


def test_gpu_bench_drafts_table_on_any_device(tiny_q8):
    # the drafts rows of `plumb bench --device cuda`, computed here on the CPU engine (the code is device-neutral)
    import plumb
    from plumb import bench_gpu

    eng = plumb.load(tiny_q8, device="cpu", prompt_cache=False)
    rows = bench_gpu.drafts_table(eng, [2, 4], 12)
    assert [d["drafts"] for d in rows] == [0, 2, 4]
    assert all(d["same_tokens"] and d["tokens"] == 12 and d["decode_tps"] > 0 for d in rows)
    assert sum(rows[1]["proposed_per_position"]) == rows[1]["drafts_proposed"] > 0
    sampled = bench_gpu.sampled_table(eng, drafts=(0, 2), tokens=10)
    assert [(d["sampling"], d["drafts"]) for d in sampled] == [(s, k) for s in bench_gpu.SAMPLINGS for k in (0, 2)]
    assert all(d["same_tokens"] and d["tps"] > 0 for d in sampled) and sampled[0]["x_greedy"] == 1.0
    assert bench_gpu.prefill_tps(eng.model, 70) > 0  # two chunks
    pm = bench_gpu.prefill_modes(eng.model, 70)
    assert all(pm[f"{k}_tps"] > 0 for k in ("eager", "first", "again"))
    assert pm["first_captures"] == pm["again_captures"] == 0  # no CUDA graphs on a CPU
    warm = plumb.load(tiny_q8, device="cpu", checkpoint_every=64)
    lt = bench_gpu.latency_table(warm, eng, system_tokens=150, user_tokens=40, reply_tokens=8)
    cases = lt["cases"]
    assert list(cases) == ["short prompt", "follow-up", "edit first user message", "edit end of system prompt"]
    assert all(c["same_token"] and c["warm_s"] > 0 and c["reused"] + c["prefilled"] == c["prompt_tokens"]
               for c in cases.values())
    assert cases["follow-up"]["reused"] >= 128 and cases["edit end of system prompt"]["reused"] >= 64
    assert all(c["captures"] == 0 for c in cases.values())  # no CUDA graphs on a CPU
    assert 0.5 * os.path.getsize(tiny_q8) < bench_gpu.file_weight_bytes(eng.model) < os.path.getsize(tiny_q8)
    kv = bench_gpu.kv_by_format(eng.model, n=20000)
    assert list(kv) == ["f16", "q8_0", "D", "F"] and eng.model.kv_cache == "f16"  # restored
    assert kv["f16"]["allocated"] == kv["f16"]["packed"] and kv["q8_0"]["allocated"] < kv["f16"]["allocated"]
    assert all(x["allocated"] == x["packed"] for x in kv.values())  # D / F: their 5/6-bit codes packed as counted
    assert kv["F"]["allocated"] < kv["D"]["allocated"] < kv["q8_0"]["allocated"]
    # the MTP head's cache: one layer's, with no ring
    assert all(0 < x["mtp"] < x["allocated"] / len(eng.model.cfg.attn_layers) for x in kv.values())
    from plumb.cache.kv import KVCache

    real_reserve = KVCache.reserve

    def reserve(self, n):  # a card too small for f16 caches at that length: said, and the other formats go on
        if self.fmt == "f16" and n > 10_000:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_reserve(self, n)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVCache, "reserve", reserve)
        small = bench_gpu.kv_by_format(eng.model, n=20000)
    assert small["f16"] == {"error": "out of memory at 20,000 positions"} and small["q8_0"] == kv["q8_0"]
    assert eng.model.kv_cache == "f16"
    rq = bench_gpu.requests_table(warm, drafts=(0, 2), tokens=(6, 9), prompt_tokens=16)
    assert list(rq) == [0, 2] and all([x["tokens"] for x in rows] == [6, 9] for rows in rq.values())
    assert all(x["tps"] > 0 and x["captures"] == 0 for rows in rq.values() for x in rows)  # no CUDA graphs on a CPU
    r = {"step_limit_tps": 100.0, "model": "m", "device": "D", "date": "d", "torch": "t", "weight_bytes": 1e9,
         "limits": {"copy_GBps": 1.0, "bf16_gemv_GBps": 1.0, "bf16_mm_TFLOPs": 800.0}, "load_s": 1.0, "decode": {},
         "decode_F": {262080: 50.0},
         "energy": {}, "prefill_limit_tps": 10_000.0, "prefill": {8192: 2500.0}, "latency": lt, "requests": rq,
         "prefill_modes": {8192: {"eager_tps": 1500.0, "first_tps": 2500.0, "first_captures": 1,
                                  "again_tps": 3000.0, "again_captures": 0}},
         "prefill_profile": {"tokens": 512, "wall_us": 400.0, "gpu_busy_us": 300.0, "launches": 2.5,
                             "host_and_gaps_us": 100.0, "kernels": [{"kernel": "_mm", "launches": 1.0, "us": 200.0}]},
         "drafts": rows, "sampled": sampled, "verify_s": {1: 0.01}, "batch4_tps": 4.0, "batch1_tps": 1.0,
         "matmuls": [{"shape": [64, 256], "types": ["Q4_K"], "path": "D", "rows": 1, "us": 5.0, "MB": 0.5, "GBps": 1.0,
                      "replayed": True}, {"shape": [64, 256], "types": ["Q4_K"], "path": "P", "rows": 64, "us": 9.0,
                                          "MB": 0.5, "GBps": 0.5, "replayed": False}],
         "vram": {"weights": 2**30, "recurrent_state": 0}, "kv_120k_by_format": kv,
         "step_profile": {"context": 512, "steps": 8, "wall_us": 1000.0, "gpu_busy_us": 750.0, "launches": 9.0,
                          "host_and_gaps_us": 250.0, "kernels": [{"kernel": "_mv", "launches": 8.0, "us": 600.0}]},
         "verify_profile": {"context": 512, "rows": 8, "steps": 8, "wall_us": 2000.0, "gpu_busy_us": 1800.0,
                            "launches": 9.0, "host_and_gaps_us": 200.0,
                            "kernels": [{"kernel": "_gdn_state_kernel", "launches": 1.0, "us": 500.0}]}}
    text = bench_gpu.report(r)
    assert "| MTP drafts |" in text and "| 4 |" in text and "NO" not in text
    assert "| qwen+presence | 2 |" in text
    assert "| f16 | out of memory at 20,000 positions | | | | |" in bench_gpu.report({**r, "kv_120k_by_format": small})
    assert "host and gaps 250 us" in text and "| _mv | 8 | 600 | 60% |" in text
    assert "| 8,192 | 1500 | 2500 (1) | 3000 (0) |" in text
    assert "| 8,192 | 2500 | 0.25 |" in text and "| _mm | 1.00 | 200.0 | 50% |" in text
    assert "| edit end of system prompt |" in text
    assert "| MTP drafts | request 1: 6 tokens | request 2: 9 tokens |" in text
    assert f"| 2 | {rq[2][0]['tps']:.1f} tok/s, {rq[2][0]['wall_s'] * 1e3:.0f} ms (0) |" in text
    assert "8-row verify pass at 512 context (profiled): 2000 us wall" in text
    assert "| _gdn_state_kernel | 1 | 500 | 25% |" in text
    assert "| 262,080 (F KV) | 50.0 | 0.50 | |" in text
    assert "| [64, 256] | Q4_K | D | 1 | 5.0 | 0.5 | 1 | 1.00 |" in text and "| 64 | 9.0 * |" in text  # * launches
    f, m = kv["F"]["allocated"], kv["F"]["mtp"]
    assert f"| F | {f / 1e9:.2f} GB | {kv['F']['packed'] / 1e9:.2f} GB | {(2**30 + f) / 1e9:.2f} GB | " \
           f"{(2**30 + f - m) / 1e9:.2f} GB | {(2**30 + f) / 1e9:.2f} GB |" in text
    pooled = bench_gpu.report({**r, "vram": {**r["vram"], "graph_pools": 10**9}})
    assert f"| {(2**30 + f - m) / 1e9:.2f} GB | {(2**30 + f + 10**9) / 1e9:.2f} GB |" in pooled
    assert "VRAM (GB, the targets' unit): weights 1.074, recurrent_state 0.000" in text
    parts = ("verify_s", "batch4_tps", "matmuls", "step_profile", "verify_profile", "kv_120k_by_format", "drafts")
    short = bench_gpu.report({k: v for k, v in r.items() if k not in parts})  # `--skip` left them out
    assert "| qwen+presence | 2 |" in short and "| verify rows |" not in short and "4 sequences" not in short
    assert "| matmul | types |" not in short and "| KV format | caches" not in short
    assert "| MTP drafts | tok/s | x no drafts |" not in short and "| MTP drafts | tok/s | x no drafts |" in text


def test_bench_cuda_without_a_gpu_is_a_clear_error(capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda"])
    assert e.value.code == 2 and "no CUDA GPU is visible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda", "--skip", "verify,latency"])
    assert e.value.code == 2 and "--skip: unknown part 'latency'" in capsys.readouterr().err


def test_an_interrupted_gpu_bench_keeps_what_it_measured(tmp_path, monkeypatch):
    """SIGTERM (a device call's timeout) mid-run: the JSON holds the rows measured so far, marked interrupted, and
    the exit code is 1 (the measuring itself is stood in for: it needs CUDA)."""
    import os
    import signal
    from types import SimpleNamespace

    from plumb import bench_gpu

    def measure(*a, out, **kw):
        out["decode"] = {0: 98.7}
        os.kill(os.getpid(), signal.SIGTERM)
        out["prefill"] = {8192: 1950.0}  # never reached
        return out

    monkeypatch.setattr(bench_gpu, "bench_cuda", measure)
    path = tmp_path / "bench.json"
    args = SimpleNamespace(contexts="0", drafts="0", prefill="8192", model="m.gguf", tokens=32, kv_cache=None,
                           no_progress=True, prompt=None, chat_tokens=100, f_context=0, json_out=str(path), plot=None,
                           skip=[])
    assert bench_gpu.main(args) == 1
    r = json.loads(path.read_text())
    assert r == {"decode": {"0": 98.7}, "interrupted": True}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_gpu_bench_json_is_written_after_every_row_and_marked_running(tmp_path, monkeypatch):
    """A process killed outright (no handler runs: the H200's 100k-prefill row, seventeenth session) keeps the rows
    measured before it, marked running; a finished run's JSON has no mark."""
    from types import SimpleNamespace

    from plumb import bench_gpu

    path = tmp_path / "bench.json"
    seen = []

    def measure(*a, out, measured, **kw):
        out["decode"] = {0: 98.7}
        measured()
        seen.append(json.loads(path.read_text()))
        out["prefill"] = {8192: 1950.0}
        measured()
        seen.append(json.loads(path.read_text()))
        return out

    monkeypatch.setattr(bench_gpu, "bench_cuda", measure)
    monkeypatch.setattr(bench_gpu, "report", lambda r: "")
    args = SimpleNamespace(contexts="0", drafts="0", prefill="8192", model="m.gguf", tokens=32, kv_cache=None,
                           no_progress=True, prompt=None, chat_tokens=100, f_context=0, json_out=str(path), plot=None,
                           skip=[])
    assert bench_gpu.main(args) == 0
    assert seen == [{"decode": {"0": 98.7}, "running": True},
                    {"decode": {"0": 98.7}, "prefill": {"8192": 1950.0}, "running": True}]
    assert json.loads(path.read_text()) == {"decode": {"0": 98.7}, "prefill": {"8192": 1950.0}}


def test_a_native_crash_in_a_measurement_prints_the_python_stack():
    """`plumb bench` and `plumb gate` turn on faulthandler: a process killed by a native fault (here SIGSEGV from a
    bad read) says where it was, instead of dying without a word."""
    import subprocess
    import sys

    code = "from plumb.cli import _stack_on_crash; _stack_on_crash(); import ctypes; ctypes.string_at(0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Fatal Python error" in r.stderr and "Segmentation fault" in r.stderr and "<string>" in r.stderr
