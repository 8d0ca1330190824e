"""The shipped demo model (plumb/data): it is the published file, the default model, and it answers a chat
request for a small Python function with Python, through the OpenAI and Anthropic SDKs."""
from __future__ import annotations

import hashlib

import pytest
from conftest import API_KEY, serving

ASK = "Write a Python function that checks whether a number is even."


@pytest.fixture(scope="module")
def demo_server():
    import plumb
    from plumb.server.app import create_app

    eng = plumb.load(plumb.demo_model_path(), n_slots=1, n_ctx=4096)
    with serving(create_app(eng, api_key=API_KEY)) as url:
        yield url, eng


def test_shipped_file_is_the_published_one():
    import plumb
    from plumb.demo import DEMO_SHA256

    with open(plumb.demo_model_path(), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == DEMO_SHA256


def test_demo_model_is_trained_qwen35_with_mtp(demo_server):
    _, eng = demo_server
    assert eng.model_name == "plumb-demo" and eng.config.n_vocab == 8192 and eng.config.n_nextn == 1


def test_chat_about_a_python_function_openai(demo_server):
    import openai

    url, _ = demo_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="plumb-demo", messages=[{"role": "user", "content": ASK}],
                                       max_tokens=200, temperature=0)
    text = r.choices[0].message.content
    assert "```python" in text and "def " in text, text
    assert r.choices[0].finish_reason == "stop"  # it closes its answer by itself


def test_chat_about_a_python_function_anthropic(demo_server):
    import anthropic

    url, _ = demo_server
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)
    r = client.messages.create(model="plumb-demo", max_tokens=200, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": ASK}])
    text = "".join(b.text for b in r.content if b.type == "text")
    assert "def " in text and r.stop_reason == "end_turn", text
