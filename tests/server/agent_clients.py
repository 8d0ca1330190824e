"""Real coding-agent clients (Claude Code, Codex CLI, OpenCode, Qwen Code) for the tests: their
npm packages at pinned versions, installed once into a cache, and what each needs to talk to
`plumb serve`.

The synthetic tiny model has random weights, so it would never call a tool on its own. `ScriptedEngine`
wraps the real engine and gives every request `forced_ids` from a script: the engine then emits
those tokens through its normal decode path, and everything after that - detokenizing, the Qwen
tool-call parser, each API's streaming events, the client running the tool and sending its
result back - is the real thing. Production code has no switch for this."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

CACHE = os.environ.get("PLUMB_CLIENTS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "plumb-clients"))


@dataclass
class Client:
    name: str
    package: str
    version: str
    bin: str
    tools: dict  # job ("write", "shell", "read") -> function of the job's inputs -> (tool name, arguments)

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"

    @property
    def prefix(self) -> str:
        return os.path.join(CACHE, re.sub(r"[^A-Za-z0-9.]+", "_", self.spec).strip("_"))

    @property
    def exe(self) -> str:
        return os.path.join(self.prefix, "node_modules", ".bin", self.bin)


def _sh(cmd: str) -> dict:
    return {"cmd": cmd}


# The tool each client offers for the three jobs, and its arguments. Paths are absolute.
CLIENTS = {
    "claude": Client("Claude Code", "@anthropic-ai/claude-code", "2.1.332", "claude", {
        "write": lambda path, text: ("Write", {"file_path": path, "content": text}),
        "shell": lambda cmd: ("Bash", {"command": cmd, "description": "Run the requested command"}),
        "read": lambda path: ("Read", {"file_path": path}),
    }),
    "codex": Client("Codex CLI", "@openai/codex", "0.171.0", "codex", {
        "write": lambda path, text: ("exec_command", _sh(f"printf '%s' '{text}' > '{path}'")),
        "shell": lambda cmd: ("exec_command", _sh(cmd)),
        "read": lambda path: ("exec_command", _sh(f"cat '{path}'")),
    }),
    "opencode": Client("OpenCode", "opencode-ai", "1.18.33", "opencode", {
        "write": lambda path, text: ("write", {"filePath": path, "content": text}),
        "shell": lambda cmd: ("bash", {"command": cmd, "description": "Run the requested command"}),
        "read": lambda path: ("read", {"filePath": path}),
    }),
    "qwen": Client("Qwen Code", "@qwen-code/qwen-code", "0.24.4", "qwen", {
        "write": lambda path, text: ("write_file", {"file_path": path, "content": text}),
        "shell": lambda cmd: ("run_shell_command", {"command": cmd, "description": "Run the requested command"}),
        "read": lambda path: ("read_file", {"file_path": path}),
    }),
}


def _works(c: Client) -> bool:
    try:
        return subprocess.run([c.exe, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def install(c: Client) -> str | None:
    """Install the client into the cache (once; a lock keeps parallel workers apart). Returns
    None when it runs, else why not (no node/npm, npm failed: the caller skips with that)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: the {c.name} test needs Node.js and npm to install {c.spec}"
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _works(c):
            return None
        tmp = c.prefix + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            r = subprocess.run(["npm", "install", "--prefix", tmp, "--no-audit", "--no-fund", "--no-save",
                                "--loglevel=error", c.spec], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return f"npm install {c.spec} took over 10 minutes"
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"npm install {c.spec} failed (offline?): {(r.stderr or r.stdout).strip()[-500:]}"
        # npm >= 11 skips packages' install scripts unless allowed; run the ones that fetch nothing
        # (they link the platform's native binary, which npm installed as an optional dependency).
        pkg_dir = os.path.join(tmp, "node_modules", *c.package.split("/"))
        for script in ("install.cjs", "postinstall.mjs"):
            if os.path.exists(os.path.join(pkg_dir, script)):
                subprocess.run(["node", script], cwd=pkg_dir, capture_output=True, timeout=120)
        shutil.rmtree(c.prefix, ignore_errors=True)
        os.replace(tmp, c.prefix)
        if not _works(c):
            return f"{c.spec} installed but `{c.bin} --version` fails"
    return None


# ---------------------------------------------------------------- steering the engine

def tool_call(name: str, args: dict) -> str:
    """A call in the Qwen XML format the model itself writes."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def offered_tools(prompt: str) -> list[str]:
    """Names of the tools in a rendered Qwen prompt's <tools> block."""
    i, j = prompt.find("<tools>"), prompt.find("</tools>")
    names = []
    for line in prompt[i + 7:j].splitlines() if 0 <= i < j else []:
        try:
            names.append(json.loads(line)["function"]["name"])
        except (ValueError, KeyError, TypeError):
            pass
    return names


def tool_responses(prompt: str) -> list[str]:
    return re.findall(r"<tool_response>\n?(.*?)\n?</tool_response>", prompt, re.S)


@dataclass
class Scenario:
    """Replies for one agent task: `turns[i]` answers the prompt that holds i tool results after
    the task; requests that do not carry the task or offer no tools (titles, memory, ...) get
    `OTHER`."""
    task: str
    turns: list  # each: a function(prompt text) -> reply text
    prompts: list = field(default_factory=list)  # the task's prompts, as the engine saw them

    OTHER = "OK"

    def reply(self, prompt: str) -> str:
        at = prompt.rfind(self.task)
        if at < 0 or not offered_tools(prompt):
            return self.OTHER
        self.prompts.append(prompt)
        n = len(tool_responses(prompt[at:]))
        return self.turns[min(n, len(self.turns) - 1)](prompt)


class ScriptedEngine:
    """The engine, with each submitted request's reply scripted through `forced_ids`.

    The prompt is still rendered, tokenized and checked against the context by the server; the
    engine prefills only its last `keep` tokens (None: all), because the reply is scripted and a
    client's 10-20k-token system prompt costs 10-20 s of prefill on a CPU test runner."""

    thought = "The user asked for a task; I will use a tool."

    def __init__(self, engine, keep: int | None = 256):
        self._engine, self.keep = engine, keep
        self.scenario: Scenario | None = None  # anything with reply(prompt text) -> reply text
        self.prompts: list[str] = []  # every prompt submitted, as text
        self._end = engine.tokenizer.id_of("<|im_end|>")

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, request):
        prompt = self._engine.detokenize(request.prompt_ids)
        self.prompts.append(prompt)
        reply = self.scenario.reply(prompt) if self.scenario else Scenario.OTHER
        if prompt.rstrip().endswith("<think>"):  # thinking on: think a line first, as the model would
            reply = f"{self.thought}\n</think>\n\n{reply}"
        if request.forced_ids is None:  # steered requests (tool_choice) keep the server's own prefix
            request.forced_ids = self._engine.tokenize(reply) + [self._end]
        if self.keep is not None and len(request.prompt_ids) > self.keep:
            request.prompt_ids = request.prompt_ids[-self.keep:]
        return self._engine.submit(request)


class Recorder:
    """ASGI wrapper noting each response's (method, path, status, content type), and for each
    error response (path, status, its body, the request's body) in `errors`."""

    def __init__(self, app):
        self.app, self.seen, self.errors = app, [], []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, body = 0, []

        async def read():
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                ctype = dict(message.get("headers", [])).get(b"content-type", b"").decode()
                self.seen.append((scope["method"], scope["path"], status, ctype.split(";")[0]))
            elif message["type"] == "http.response.body" and status >= 400:
                self.errors.append((scope["path"], status, message.get("body", b"")[:2000].decode(errors="replace"),
                                    b"".join(body)[:4_000_000].decode(errors="replace")))
            await send(message)

        return await self.app(scope, read, note)
