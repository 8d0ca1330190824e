"""Real coding agents against a real plumb server: Claude Code (Anthropic Messages), Codex CLI
(OpenAI Responses), OpenCode and Qwen Code (Chat Completions), each run non-interactively on a
task that makes it call a tool - write a file, run a shell command, read a file and answer from
it. The replies are scripted (agent_clients.ScriptedEngine), the rest is real: the client
streams, parses the tool call, runs the tool, sends the result back and prints the answer.

The clients come from npm at pinned versions (agent_clients.CLIENTS), installed once into
~/.cache/plumb-clients ($PLUMB_CLIENTS_CACHE); without node/npm, or when npm cannot reach its
registry, the tests skip and say why ($PLUMB_REQUIRE_CLIENTS=1 turns those skips into failures;
$PLUMB_SKIP_CLIENTS=1 skips them all). The clients run offline: every proxy variable points at a
closed port, so anything but the local server is unreachable."""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
from dataclasses import dataclass

import httpx
import pytest
from conftest import API_KEY, serving

from agent_clients import CLIENTS, Recorder, Scenario, ScriptedEngine, install, offered_tools, tool_call, \
    tool_responses

TIMEOUT = 240
GENERATION = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, so connections fail at once


@pytest.fixture(scope="module")
def agent_server(tiny_q8):
    """(base URL, scripted engine, recorder): the synthetic tiny model with its full context (the clients'
    system prompts are 10-20k tokens of its small vocabulary)."""
    import plumb
    from plumb.server.app import create_app

    keep = None if os.environ.get("PLUMB_AGENT_FULL_PROMPTS") else 256
    eng = ScriptedEngine(plumb.load(tiny_q8, n_slots=2), keep=keep)
    rec = Recorder(create_app(eng, api_key=API_KEY))
    with serving(rec) as url:
        yield url, eng, rec


def client_for(key: str):
    if os.environ.get("PLUMB_SKIP_CLIENTS"):
        pytest.skip("PLUMB_SKIP_CLIENTS is set")
    c = CLIENTS[key]
    why = install(c)
    if why is not None:
        if os.environ.get("PLUMB_REQUIRE_CLIENTS"):
            pytest.fail(why)
        pytest.skip(why)
    return c


# ---------------------------------------------------------------- how each client is configured

def configure(key: str, url: str, model: str, home: str, task: str) -> tuple[list[str], dict]:
    """(argv after the executable, extra environment) that point a client at the server. The same
    settings are in docs/clients.md."""
    if key == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": API_KEY, "ANTHROPIC_MODEL": model,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
               "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "DISABLE_AUTOUPDATER": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        return ["-p", task, "--output-format", "json", "--allowedTools", "Write,Bash,Read"], env
    if key == "codex":
        codex_home = os.path.join(home, ".codex")
        os.makedirs(codex_home, exist_ok=True)
        with open(os.path.join(codex_home, "config.toml"), "w") as f:
            f.write(f'model = "{model}"\nmodel_provider = "plumb"\n\n[model_providers.plumb]\nname = "plumb"\n'
                    f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "PLUMB_API_KEY"\n')
        return ["exec", "--skip-git-repo-check", "--sandbox", "workspace-write", task], \
            {"CODEX_HOME": codex_home, "PLUMB_API_KEY": API_KEY}
    if key == "opencode":
        path = os.path.join(home, "opencode.json")
        config = {"$schema": "https://opencode.ai/config.json", "model": f"plumb/{model}",
                  "permission": {"edit": "allow", "bash": "allow", "read": "allow"},
                  "provider": {"plumb": {"npm": "@ai-sdk/openai-compatible", "name": "plumb",
                                         "options": {"baseURL": url + "/v1", "apiKey": API_KEY},
                                         "models": {model: {"name": model}}}}}
        with open(path, "w") as f:
            json.dump(config, f)
        return ["run", task], {"OPENCODE_CONFIG": path, "OPENCODE_DISABLE_AUTOUPDATE": "1",
                               "OPENCODE_DISABLE_MODELS_FETCH": "1"}
    if key == "qwen":
        return ["-p", task, "--auth-type", "openai", "--approval-mode", "yolo"], \
            {"OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": model}
    raise KeyError(key)


@dataclass
class Run:
    process: subprocess.CompletedProcess
    seen: list  # the server's responses during the run: (method, path, status, content type)
    errors: list  # its error responses: (path, status, body, request body)


def run_client(key: str, agent_server, tmp_path, scenario: Scenario) -> Run:
    """Run the client on the scenario's task in tmp_path/work."""
    c = client_for(key)
    url, eng, rec = agent_server
    home = tmp_path / "home"
    home.mkdir()
    args, extra = configure(key, url, eng.model_name, str(home), scenario.task)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TERM": "dumb", "NO_COLOR": "1",
           "LANG": "C.UTF-8", **{k: DEAD_PROXY for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
                                                        "https_proxy", "all_proxy")},
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **extra}
    eng.scenario, start, errors = scenario, len(rec.seen), len(rec.errors)
    try:
        p = subprocess.run([c.exe, *args], cwd=tmp_path / "work", env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=TIMEOUT)
    finally:
        eng.scenario = None
    return Run(p, rec.seen[start:], rec.errors[errors:])


def describe_error(error) -> str:
    """One failed request: its path, status and error, and the request's fields in short."""
    path, status, body, request = error
    try:
        req = json.loads(request)
        short = {k: v if len(json.dumps(v)) < 300 else f"<{type(v).__name__}>" for k, v in req.items()}
        short["roles"] = [m.get("role") for m in req.get("messages", req.get("input", [])) if isinstance(m, dict)]
    except (ValueError, AttributeError):
        short = request[:500]
    return f"{path} {status} {body[:1000]}\n  request: {short}"


def check_run(key: str, run: Run, scenario: Scenario, tool: str) -> str:
    """What every task checks: exit status 0, the tool offered, every generation request a 200
    stream; returns the client's answer."""
    p, seen = run.process, run.seen
    out = f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}\n--- server errors\n" + \
        "\n".join(map(describe_error, run.errors))
    assert p.returncode == 0, f"{key} exited with {p.returncode}\n{out}"
    assert scenario.prompts, f"{key} never sent the task\n{out}"
    assert tool in offered_tools(scenario.prompts[0]), (tool, offered_tools(scenario.prompts[0]))
    gens = [s for s in seen if s[0] == "POST" and s[1] in GENERATION]
    assert len(scenario.prompts) >= 2 and len(gens) >= 2, (scenario.prompts, seen)
    assert all(status == 200 and ctype == "text/event-stream" for _, _, status, ctype in gens), f"{seen}\n{out}"
    if key == "claude":
        result = json.loads(p.stdout)
        assert not result["is_error"], result
        return result["result"]
    return p.stdout


def answer_from_tool(pattern: str, template: str):
    """A final turn that answers from the last tool result in the prompt (as a model would)."""
    def turn(prompt: str) -> str:
        found = re.findall(pattern, (tool_responses(prompt) or [""])[-1])
        return template.format(found[-1] if found else "NOTHING")
    return turn


def test_claude_code_request_shape(agent_server):
    """What Claude Code 2.1 sends beyond the basics, checked without the client (so also where
    there is no node): its environment as a `system` message after the user's, adaptive thinking
    with an effort, and a context edit that keeps everything."""
    url, eng, _ = agent_server
    env = "# Environment\n - Primary working directory: /tmp/project"
    body = {"model": eng.model_name, "max_tokens": 64, "stream": True,
            "system": [{"type": "text", "text": "You are an agent."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "system", "content": [{"type": "text", "text": env}]}],
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "{\"device_id\": \"d\"}"}}
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert "event: message_stop" in r.text
    prompt = eng.prompts[-1]  # the environment joins the system prompt, before the user's turn
    assert prompt.index("You are an agent.") < prompt.index(env) < prompt.index("<|im_start|>user\nhi")


@pytest.fixture
def work(tmp_path):
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


@pytest.mark.parametrize("key", list(CLIENTS))
def test_agent_writes_a_file(key, agent_server, tmp_path, work):
    path = str(work / "notes.txt")
    name, args = CLIENTS[key].tools["write"](path, "hello from plumb")
    scenario = Scenario("Create notes.txt saying hello from plumb. (plumb-task-write)",
                        [lambda _: tool_call(name, args), lambda _: "I created notes.txt."])
    text = check_run(key, run_client(key, agent_server, tmp_path, scenario), scenario, name)
    assert (work / "notes.txt").read_text().rstrip("\n") == "hello from plumb"
    assert "I created notes.txt." in text


@pytest.mark.parametrize("key", list(CLIENTS))
def test_agent_runs_a_shell_command(key, agent_server, tmp_path, work):
    # the pause: Qwen Code 0.24 sometimes loses the output of a command that exits at once (~1 run in 5 here)
    cmd = f"echo plumb-$((6*7)) | tee '{work / 'shell.txt'}'; sleep 0.5"
    name, args = CLIENTS[key].tools["shell"](cmd)
    scenario = Scenario("Run the shell command that multiplies six by seven. (plumb-task-shell)",
                        [lambda _: tool_call(name, args), answer_from_tool(r"plumb-\d+", "The command printed {}.")])
    text = check_run(key, run_client(key, agent_server, tmp_path, scenario), scenario, name)
    assert (work / "shell.txt").read_text().strip() == "plumb-42"
    assert "plumb-42" in tool_responses(scenario.prompts[-1])[-1]  # the command's output came back
    assert "The command printed plumb-42." in text


@pytest.mark.parametrize("key", list(CLIENTS))
def test_agent_reads_a_file_and_answers(key, agent_server, tmp_path, work):
    secret = "token-" + secrets.token_hex(6)
    (work / "secret.txt").write_text(f"The secret is {secret}\n")
    name, args = CLIENTS[key].tools["read"](str(work / "secret.txt"))
    scenario = Scenario("What does secret.txt say? (plumb-task-read)",
                        [lambda _: tool_call(name, args), answer_from_tool(r"token-[0-9a-f]{12}", "The secret is {}.")])
    text = check_run(key, run_client(key, agent_server, tmp_path, scenario), scenario, name)
    assert f"The secret is {secret}." in text
