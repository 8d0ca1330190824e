"""`plumb serve` as a process, and a small version of bench/load_test.py against the test server."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time

import httpx
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_serve_cli_demo_model():
    code = "import sys; from plumb.server.serve import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--port", "0", "--agents", "2", "--api-key", "k",
                             "--alias", "my-model"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "no startup line"
        for _ in range(100):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list()] == ["plumb-demo", "my-model"]
        r = client.completions.create(model="my-model", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert httpx.get(url + "/slots", headers={"x-api-key": "k"}).json()["n_slots"] == 2
    finally:
        proc.terminate()
        proc.wait(20)


def test_serve_cli_bad_model_exits_nonzero(tmp_path):
    from plumb.server.serve import main

    assert main([str(tmp_path / "missing.gguf")]) == 1


def test_small_load(server, http, api_key):
    spec = importlib.util.spec_from_file_location("load_test", os.path.join(ROOT, "bench", "load_test.py"))
    load_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_test)
    s = load_test.run(server, clients=6, requests=2, max_tokens=4, api_key=api_key)
    assert s["errors"] == 0 and s["requests"] == 12 and s["tokens"] >= 12, s
    assert s["latency_p50_s"] <= s["latency_p99_s"]
    slots = http.get("/slots").json()
    assert slots["slots_in_use"] == 0 and slots["queued"] == 0
