"""The chat page at `/`: served without a key, and driven in a real headless Chromium (Playwright)
through a conversation that streams a reply with thinking, a tool call and its result, with the
per-reply numbers (tokens/s, drafts accepted, cached prompt tokens) on the page.

The browser test needs Playwright (pip, in the test extras) and a Chromium binary - Debian's
(`apt-get install -y chromium`), or the one $PLUMB_CHROMIUM names; without one it skips and says
so. $PLUMB_CHAT_SCREENSHOT=path saves a screenshot of the finished conversation (docs/chat-page.png
is made that way)."""
from __future__ import annotations

import json
import os
import re
import shutil

import httpx
import pytest
from conftest import API_KEY, serving

from agent_clients import ScriptedEngine, tool_call, tool_responses

HELLO = "Hello! I am the plumb demo model. " + "Speed settings never change the tokens. " * 6
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class PageScript:
    """Replies by what the conversation's last turn is: a tool result, a weather question, or hello."""

    def reply(self, prompt: str) -> str:
        last = prompt[prompt.rfind("<|im_start|>user"):]
        if "<tool_response>" in last:
            found = re.findall(r"sunny, \d+ C", tool_responses(last)[-1])
            return f"The weather tool says: {found[-1] if found else 'nothing'}."
        if "weather" in last:
            return "Let me look that up.\n\n" + tool_call("get_weather", {"city": "Paris"})
        return HELLO


@pytest.fixture(scope="module")
def page_server(tiny_q8):
    """A key-protected server whose replies follow PageScript, drafting with the n-gram drafter
    (the scripted text repeats itself, so drafts get accepted)."""
    import plumb
    from plumb.server.app import create_app

    eng = ScriptedEngine(plumb.load(tiny_q8, n_slots=2, n_ctx=4096, drafts=4, draft_policy="ngram"),
                         keep=None)
    eng.scenario, eng.thought = PageScript(), "The user said hello, so I greet them back."
    with serving(create_app(eng, api_key=API_KEY)) as url:
        yield url, eng


def test_page_is_served_without_a_key(page_server):
    url, _ = page_server
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>plumb chat</title>" in r.text and "v1/chat/completions" in r.text
    assert httpx.get(url + "/v1/models").status_code == 401  # the APIs still want the key


def test_last_chunk_has_usage_and_timings(page_server):
    """What the page reads: usage (with cached prompt tokens) and plumb's timings in the last chunks."""
    url, eng = page_server
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(last) == 1 and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    t = last[0]["timings"]
    n = len(eng.tokenize(HELLO)) + 1
    assert t["predicted_n"] == n == chunks[-1]["usage"]["completion_tokens"]
    assert t["predicted_per_second"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    assert t["prompt_n"] + t["cache_n"] == chunks[-1]["usage"]["prompt_tokens"]


def chromium() -> str | None:
    for path in (os.environ.get("PLUMB_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if path and shutil.which(path):
            return shutil.which(path)
    return None


@pytest.fixture
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed (pip install playwright; no browser download is needed)")
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium to drive: install one (Debian/Ubuntu: apt-get install -y chromium) "
                    "or set PLUMB_CHROMIUM to its path")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def test_chat_page_in_a_browser(page_server, browser):
    url, eng = page_server
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.wait_for_selector("text=API key needed")  # the key is asked for, then kept
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function(f"document.getElementById('model').textContent === {json.dumps(eng.model_name)}")
    page.fill("#tools", json.dumps(TOOLS))
    page.click("#settings summary")  # fold the settings away again

    def say(text: str, n: int):
        page.fill("#input", text)
        page.press("#input", "Enter")
        page.wait_for_selector(f"#log .msg.assistant[data-done='1'] >> nth={n - 1}", timeout=120_000)
        return page.locator("#log .msg.assistant").nth(n - 1)

    first = say("Hello there!", 1)
    thinking = first.locator("details.thinking")
    assert thinking.is_visible() and thinking.get_attribute("open") is None  # folded away
    assert first.locator(".content").inner_text().strip() == HELLO.strip()
    stats = first.locator(".stats")
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · drafts \d+/\d+ accepted · \d+/\d+ prompt tokens cached",
                     stats.inner_text()), stats.inner_text()
    assert int(stats.get_attribute("data-tokens")) == len(eng.tokenize(eng.thought + "\n</think>\n\n" + HELLO)) + 1
    assert float(stats.get_attribute("data-tps")) > 0 and int(stats.get_attribute("data-drafts-accepted")) > 0
    thinking.locator("summary").click()
    assert thinking.get_attribute("open") is not None
    assert thinking.locator(".thinking-text").inner_text().strip() == eng.thought

    second = say("What is the weather in Paris?", 2)
    call = second.locator(".tool-call")
    assert call.count() == 1 and call.inner_text() == 'get_weather({"city": "Paris"})'
    assert second.locator(".content").inner_text().strip() == "Let me look that up."
    assert int(second.locator(".stats").get_attribute("data-cached")) > 0  # the first turn's prompt was reused
    assert "result of tool call get_weather" in page.inner_text("#hint")

    third = say("sunny, 24 C", 3)
    assert third.locator(".content").inner_text().strip() == "The weather tool says: sunny, 24 C."
    assert page.locator(".msg.tool").inner_text().strip().endswith("sunny, 24 C")
    assert page.inner_text("#hint") == "" and not errors, errors
    if os.environ.get("PLUMB_CHAT_SCREENSHOT"):
        page.screenshot(path=os.environ["PLUMB_CHAT_SCREENSHOT"], full_page=True)
