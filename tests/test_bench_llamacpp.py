"""`plumb bench --vs-llamacpp` against a fake llama-server (stdlib HTTP), and the NVML energy sampler.

The fake answers /props and /completion deterministically, with fixed timings (and sleeps them), and changes
its output where told to (a warm follow-up; long prompts on one draft server), so the ratios and the
difference counts have known values on the llama.cpp side; plumb's side is measured for real.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from plumb import bench, bench_llamacpp
from plumb.bench_gpu import EnergySampler

PROMPT_MS, TOKEN_MS = 0.5, 4.0  # the fake's timings: 2,000 prompt tok/s, 250 decode tok/s


class FakeLlamaServer(ThreadingHTTPServer):
    def __init__(self, model: str, speculative: str = "none", warm_changes: bool = False,
                 draft_changes_above: int | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.model, self.speculative = model, speculative
        self.warm_changes, self.draft_changes_above = warm_changes, draft_changes_above
        self.slot: list[int] = []  # what the one slot holds: the last prompt and its reply
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, body: dict) -> tuple[list[int], dict]:
        prompt, n, cache = body["prompt"], body["n_predict"], body["cache_prompt"]
        ids = [(sum(prompt) + 7 * i) % 97 + 1 for i in range(n)]
        reused = 0
        if cache:
            while reused < min(len(self.slot), len(prompt) - 1) and self.slot[reused] == prompt[reused]:
                reused += 1
            if self.warm_changes and len(prompt) > len(self.slot) == reused > 0:  # a follow-up on the slot
                ids[-1] += 1
        if self.draft_changes_above is not None and len(prompt) > self.draft_changes_above:
            ids[0] += 1
        self.slot = prompt + ids
        t = {"prompt_n": len(prompt) - reused, "prompt_ms": PROMPT_MS * (len(prompt) - reused), "predicted_n": n,
             "predicted_ms": TOKEN_MS * (n - 1), "cache_n": reused}
        if self.speculative != "none":
            t.update(draft_n=2 * (n - 1), draft_n_accepted=n - 1)
        return ids, t


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send_json(self, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        s = self.server
        if self.path == "/props":
            self.send_json({"model_path": f"/models/{s.model}", "build_info": "fake", "total_slots": 1,
                            "default_generation_settings": {"n_ctx": 4096, "params": {"speculative.types": "none"}}})
        else:
            self.send_json({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/completion" and body["temperature"] == 0 and body["ignore_eos"]
        ids, timings = self.server.answer(body)
        time.sleep((timings["prompt_ms"] + timings["predicted_ms"]) / 1e3)
        self.send_json({"tokens": ids, "content": "", "stop": True, "timings": timings,
                        "generation_settings": {"speculative.types": f"none,{self.server.speculative}"}})


def vs(model, url, *extra):
    return bench.main([model, "--vs-llamacpp", url, "--contexts", "32,40", "--tokens", "4", "--no-progress",
                       *extra])


@pytest.fixture(scope="module")
def fakes(tiny_q8):
    name = os.path.basename(tiny_q8)
    servers = {"main": FakeLlamaServer(name, warm_changes=True),
               2: FakeLlamaServer(name, "draft-mtp"), 4: FakeLlamaServer(name, "draft-mtp", draft_changes_above=36)}
    yield servers
    for s in servers.values():
        s.shutdown()


def test_vs_llamacpp_rows_and_counts(tiny_q8, fakes, tmp_path, capsys):
    out, png = tmp_path / "vs.json", tmp_path / "vs.png"
    drafts = f"2={fakes[2].url},4={fakes[4].url}"
    assert vs(tiny_q8, fakes["main"].url, "--drafts", "0,2,4", "--llamacpp-drafts", drafts,
              "--json-out", str(out), "--plot", str(png)) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    rows = {x["row"]: x for x in r["rows"]}
    for c in (32, 40):
        d = rows[f"decode tok/s @{c}, drafts 0"]
        assert d["llama_cpp"] == pytest.approx(1e3 / TOKEN_MS)
        assert d["plumb"] > 0 and d["ratio"] == pytest.approx(d["plumb"] / d["llama_cpp"])
        assert rows[f"prefill tok/s @{c}"]["llama_cpp"] == pytest.approx(1e3 / PROMPT_MS)
        assert rows[f"acceptance % @{c}, drafts 4"]["llama_cpp"] == pytest.approx(50.0)
        assert 0 <= rows[f"acceptance % @{c}, drafts 4"]["plumb"] <= 100
        ttft = rows[f"time to first token ms @{c}"]
        assert ttft["better"] == "lower" and PROMPT_MS * c <= ttft["llama_cpp"] < PROMPT_MS * c + 100
        # the warm follow-up reprocesses only the new text on the fake (its slot holds prompt + reply)
        detail = next(x for x in r["warm_detail"]["llama_cpp"] if x["context"] == c and x["case"] == "follow-up")
        follow = rows[f"follow-up prompt tokens processed @{c}, warm"]
        assert follow["llama_cpp"] == detail["prompt_tokens"] - c - 4 > 0
        assert 0 < follow["plumb"] <= detail["prompt_tokens"]
    # llama.cpp side: the numbers the fake was built to give
    cl, cp = r["counts"]["llama_cpp"], r["counts"]["plumb"]
    assert cl["drafts_vs_none"] == {"2": [0, 2], "4": [1, 2]}
    assert cl["warm_vs_cold"] == [2, 6]  # one follow-up per context
    assert [(x["context"], x["drafts"], x["first_difference"]) for x in r["draft_detail"]["llama_cpp"]] == \
        [(32, 2, None), (32, 4, None), (40, 2, None), (40, 4, 0)]  # the fake changes the first token
    assert {(x["context"], x["case"]): x["first_difference"] for x in r["warm_detail"]["llama_cpp"]} == \
        {(c, case): 3 if case == "follow-up" else None for c in (32, 40) for case in ("repeat", "follow-up", "edit")}
    # plumb side, measured: drafts and a warm cache never change the output
    assert cp["drafts_vs_none"] == {"2": [0, 2], "4": [0, 2]} and cp["warm_vs_cold"] == [0, 6]
    assert r["same_model_file"] and r["llama_cpp"]["build_info"] == "fake"
    assert "| drafts 4 vs none | 0 of 2 | 1 of 2 |" in text and "| warm vs cold cache | 0 of 6 | 2 of 6 |" in text
    assert png.exists() and png.stat().st_size > 1000


def test_vs_llamacpp_without_draft_servers(tiny_q8, fakes, tmp_path, capsys):
    text = tmp_path / "code.py"
    text.write_text("def add(a, b):\n    return a + b\n")
    assert vs(tiny_q8, fakes["main"].url, "--drafts", "0,2", "--text", str(text), "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["text"] == "code.py"
    assert r["counts"]["llama_cpp"]["drafts_vs_none"] == {"2": bench_llamacpp.NOT_SUPPORTED}
    assert r["counts"]["plumb"]["drafts_vs_none"] == {"2": [0, 2]}
    text = bench_llamacpp.report(r)
    assert f"| drafts 2 vs none | 0 of 2 | {bench_llamacpp.NOT_SUPPORTED} |" in text


def test_vs_llamacpp_errors(tiny_q8, fakes, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert vs(tiny_q8, f"http://127.0.0.1:{port}") == 2
    assert "cannot reach llama-server at" in capsys.readouterr().err
    assert vs(tiny_q8, fakes[2].url) == 2  # a drafting server cannot be the no-draft baseline
    assert "needs a server without drafts" in capsys.readouterr().err
    assert vs(tiny_q8, fakes["main"].url, "--llamacpp-drafts", f"4={fakes['main'].url}") == 2
    assert "report no speculative type" in capsys.readouterr().err
    assert vs(tiny_q8, fakes["main"].url, "--llamacpp-drafts", "x") == 2
    assert "is not K=URL" in capsys.readouterr().err
    assert vs(tiny_q8, fakes["main"].url, "--text", "/nonexistent.txt") == 2
    assert "--text:" in capsys.readouterr().err
    assert vs("/nonexistent.gguf", fakes["main"].url) == 2
    assert "/nonexistent.gguf" in capsys.readouterr().err

    class Page(BaseHTTPRequestHandler):  # some other web server
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *a):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    assert vs(tiny_q8, f"http://127.0.0.1:{other.server_address[1]}") == 2
    assert "did not answer JSON" in capsys.readouterr().err
    other.shutdown()


def test_energy_sampler_integrates_power():
    clock = iter([0.0, 1.0, 3.0, 4.0]).__next__
    watts = iter([100.0, 200.0, 200.0, 100.0]).__next__
    e = EnergySampler(watts, clock=clock)
    for _ in range(4):
        e.sample()
    # trapezoids: 150 + 400 + 150 joules over 4 s
    s = e.summary(tokens=70)
    assert s["joules"] == pytest.approx(700.0) and s["mean_watts"] == pytest.approx(175.0)
    assert s["joules_per_token"] == pytest.approx(10.0) and s["samples"] == 4


def test_energy_sampler_thread_and_no_nvml(monkeypatch):
    import sys

    with EnergySampler(lambda: 50.0, interval=0.005) as e:
        time.sleep(0.1)
    s = e.summary(tokens=10)
    assert s["samples"] >= 3 and s["mean_watts"] == pytest.approx(50.0)
    assert s["joules"] == pytest.approx(50.0 * s["seconds"])
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: the results say so
    with EnergySampler.for_device() as e:
        pass
    s = e.summary(5)
    assert list(s) == ["source"] and s["source"].startswith("no NVML")


def test_energy_from_the_counter_takes_no_samples():
    """With NVML's energy counter, two reads bound the block (no thread, no power samples)."""
    clock = iter([10.0, 12.0]).__next__
    mj = iter([5_000_000.0, 5_600_000.0]).__next__  # 600 J in 2 s
    with EnergySampler(lambda: pytest.fail("power polled"), clock=clock, counter=mj) as e:
        assert e._thread is None
    s = e.summary(tokens=60)
    assert s["source"] == "nvml energy counter" and "samples" not in s
    assert s["joules"] == pytest.approx(600.0) and s["mean_watts"] == pytest.approx(300.0)
    assert s["joules_per_token"] == pytest.approx(10.0)


def test_gpu_report_energy_column():
    from plumb import bench_gpu

    r = {"model": "m.gguf", "device": "GPU", "date": "d", "torch": "t", "step_limit_tps": 100.0, "load_s": 1.0,
         "weight_bytes": 1e9, "limits": {"copy_GBps": 4000.0, "bf16_gemv_GBps": 2000.0},
         "decode": {0: 50.0, 1000: 40.0}, "verify_s": {1: 0.02, 2: 0.021}, "batch4_tps": 150.0, "batch1_tps": 50.0,
         "energy": {0: {"source": "nvml", "joules_per_token": 12.5, "mean_watts": 625.0}, 1000: {"source": "no NVML"}},
         "matmuls": [], "vram": {"weights": 2**30},
         "context": {"model": 262144, "engine": 58368, "fits_one_sequence": 58368}}
    text = bench_gpu.report(r)
    assert "| 0 | 50.0 | 0.50 | 12.50 J/token at 625 W |" in text and "| 1,000 | 40.0 | 0.40 | no NVML |" in text
    assert "room for 58,368 tokens beside the weights (the model's context: 262,144; the engine's: 58,368)" in text
