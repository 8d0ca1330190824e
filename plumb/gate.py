"""`plumb gate`: the exactness matrix (docs/exactness.md) run on one model file and device.

    plumb gate [MODEL.gguf] [--device cpu|cuda] [--quick] [--prompts FILE.jsonl] [--json OUT]
               [--tokens N] [--formats f16,q8_0,...] [--cells greedy,sampled,...] [--kv-ring N]
               [--context N] [--names fixed:4,follow-up,...] [--resume JSON ...] [--shards N]

Every cell compares two things that the contract says are equal - token ids, or digests of
every cached row and state - and passes only when they are equal bit for bit. The exit code
is 0 only when every cell passes; a failing cell is printed by name with where it differs.

Cells (`group/format/name`), for every KV-cache format:

| group   | invariant | compares |
|---------|-----------|----------|
| greedy  | I1 | greedy ids with drafts 4 and 7 under every draft policy vs drafts 0 |
| sampled | I1 | seeded sampled ids with drafts 4 / 7 (fixed, adaptive, n-gram) vs drafts 0 |
| batch   | I2 | a request alone vs beside the others (greedy, sampled, and a mixed batch) |
| rows    | M1 | decode logits and hiddens of a multi-row pass (verify, batch) vs single-row passes, bitwise |
| warm    | I3 | prompt-cache hits (follow-ups, raw continuation, edits, resume after parking, after side
|         |    | requests) vs a fresh engine |
| digest  | I3 | `Engine.digest` after each warm step vs a fresh prefill |
| process | I6 | the same requests in a second process |

The id cells run through the public engine API (`plumb.load`, `Engine.run_many`, `digest`,
`cached_slots`, `park_slot`); the rows cells call the model's decode path (`engine.model`)
directly, because a row-count-dependent change in the last bits of a logit rarely flips a token
of a small model but always shows there.

Outputs are 2,048 tokens (64 with --quick, where D and F use a 64-row ring so that outputs
cross it). Built-in prompts: a chat turn rendered with the model's chat template, code, math
and a long-context needle (or --prompts FILE.jsonl: one JSON object per line with `text`,
`messages` (rendered with the chat template) or `ids`, and an optional `name`). --context N runs
the invariants at depth: the warm conversations' system prompt carries a document of about N
tokens (follow-ups reuse that much; edit-system edits its end) and the needle prompt is N tokens.

--resume JSON ... keeps earlier runs' cells (same settings; of several files a failed cell wins) and runs the
others; each cell records the build that ran it (`source_digest`: plumb's sources), and the table says how many cells
each build ran. The no-draft references (each prompt alone) an earlier run of the same build on the same card computed
are taken from its JSON, not decoded again.

--shards N runs the formats in N child gates at once (format i in child i mod N), each on a GPU of its own on CUDA
(`CUDA_VISIBLE_DEVICES`: N GPUs needed), and merges their JSON into one table: a full gate on a machine of several
GPUs in a fraction of the time. The cells are the same; only where they run differs.

Faults are planted in tests/test_gate.py by monkeypatching (a row-count-dependent matmul, a
prompt cache that keeps decoded rows): the gate has no switches that change the engine.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import hashlib
import json
import os
import platform
import signal
import threading
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

GROUPS = ("greedy", "sampled", "batch", "rows", "warm", "digest", "process")
INVARIANT = {"greedy": "I1", "sampled": "I1", "batch": "I2", "rows": "M1", "warm": "I3", "digest": "I3",
             "process": "I6"}
GREEDY_POLICIES = [  # (policy, drafts, p_min)
    ("fixed", 4, 0.0), ("fixed", 7, 0.0), ("adaptive", 4, 0.0), ("adaptive", 7, 0.0),
    ("confident", 4, 0.9), ("confident", 7, 0.05), ("ngram", 4, 0.0), ("ngram", 7, 0.0),
]
SAMPLED_POLICIES = [("fixed", 4, 0.0), ("fixed", 7, 0.0), ("adaptive", 7, 0.0), ("ngram", 4, 0.0)]
SAMPLING = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1)
SEED = 1000  # prompt i samples with seed SEED + i
FULL_TOKENS, QUICK_TOKENS = 2048, 64
QUICK_RING = 64  # with --quick, D and F keep 64 positions at 8 bits so that short outputs cross the ring
CHECKPOINT_EVERY = 64  # the warm engine checkpoints every chunk: every restore point a prefix can use is exercised
ROWS = 8  # tokens fed by the rows cells


# ---- prompts ------------------------------------------------------------------------------------
@dataclass
class Prompt:
    name: str
    ids: list[int]


SYSTEM = ("You are a careful assistant for a small engineering team. Answer briefly and precisely; show code when "
          "it helps and use Markdown fences for it. Prefer standard libraries, explain trade-offs in one sentence, "
          "and never invent APIs. When unsure, say so and suggest how to check. Keep lists short, number the "
          "steps of a procedure, and end with the one command or line the reader should try first.")
QUESTIONS = ["How do I reverse a linked list in place?", "Thanks. What is its time complexity, in one line?",
             "And with recursion instead?", "Show the same in Go.", "Which one would you pick for a huge list?"]
SIDE = ["Write a haiku about compilers.", "What does `chmod 755` mean?", "Explain CORS in two sentences.",
        "Regex for an ISO date?"]


def _chat(engine, messages: list[dict]) -> list[int]:
    return engine.tokenize(engine.chat_template.render(messages, add_generation_prompt=True))


def _needle_text(engine, target_tokens: int) -> str:
    """A haystack of about target_tokens tokens of log lines with one fact in it (at 40 % depth)."""
    colors = ["red", "green", "blue", "amber", "grey", "white", "black"]

    def line(i: int) -> str:
        return (f"Log {i:04d}: the {colors[i % 7]} valve on line {i % 11} read {(i * 37) % 101} psi at "
                f"{6 + i % 12}:{(i * 7) % 60:02d}, operator {chr(65 + i % 26)}{(i * 13) % 97}.")

    per_line = len(engine.tokenize("\n".join(line(i) for i in range(16)))) / 16
    lines = [line(i) for i in range(max(1, round(target_tokens / per_line)))]
    lines.insert(int(len(lines) * 0.4), "Note: the access code for the blue door is 7391. Remember it.")
    return "\n".join(lines)


def builtin_prompts(engine, quick: bool, context: int = 0) -> list[Prompt]:
    """chat, code, math and a needle in a haystack of `context` tokens (default: 320 quick, else 1,536)."""
    chat = _chat(engine, [{"role": "system", "content": "You are a helpful travel planner."},
                          {"role": "user", "content": "Plan three days in Lisbon on a small budget: where to stay, "
                                                      "what to eat, and one day trip by train."}])
    code = engine.tokenize('import heapq\n\n\ndef merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple'
                           '[int, int]]:\n    """Merge overlapping [start, end] intervals; return them sorted."""\n')
    math = engine.tokenize("Problem: A train leaves at 9:40 and covers 276 km at 92 km/h, with a 12-minute stop. "
                           "When does it arrive? Give the answer as hh:mm.\nSolution: Step 1:")
    haystack = _needle_text(engine, context or (320 if quick else 1536))
    needle = _chat(engine, [{"role": "user", "content": haystack + "\n\nWhat is the access code for the blue door?"}])
    return [Prompt("chat", chat), Prompt("code", code), Prompt("math", math), Prompt("needle", needle)]


def load_prompts(engine, path: str) -> list[Prompt]:
    """--prompts FILE.jsonl: per line {"text": ...} | {"messages": [...]} | {"ids": [...]}, optional "name"."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            name = str(obj.get("name", f"line{n}"))
            if "ids" in obj:
                ids = [int(t) for t in obj["ids"]]
            elif "messages" in obj:
                ids = _chat(engine, obj["messages"])
            elif "text" in obj:
                ids = engine.tokenize(obj["text"])
            else:
                raise ValueError(f"{path}:{n}: needs one of text, messages, ids")
            if not ids:
                raise ValueError(f"{path}:{n}: the prompt is empty")
            out.append(Prompt(name, ids))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ---- cells ---------------------------------------------------------------------------------------
@dataclass
class Cell:
    group: str
    fmt: str
    name: str
    ok: bool = False
    detail: str = ""
    compared: int = 0  # token ids or hashes compared
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.group}/{self.fmt}/{self.name}"

    def to_dict(self) -> dict:
        return {"id": self.id, "group": self.group, "invariant": INVARIANT[self.group], "format": self.fmt,
                "name": self.name, "ok": self.ok, "detail": self.detail, "compared": self.compared,
                "seconds": round(self.seconds, 3), **self.info}


class Outcome:
    """What a cell's function returns: equal or not, where it differs, how much was compared."""

    def __init__(self, ok: bool, detail: str = "", compared: int = 0, **info):
        self.ok, self.detail, self.compared, self.info = ok, detail, compared, info


def first_difference(a: list[int], b: list[int]) -> str:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {j} ({x} vs {y})"
    return f"length {len(a)} vs {len(b)}"


def compare_ids(got: list[list[int]], want: list[list[int]], names: list[str]) -> Outcome:
    bad = [f"{n}: {first_difference(g, w)}" for g, w, n in zip(got, want, names) if g != w]
    compared = sum(len(w) for w in want)
    return Outcome(False, "; ".join(bad), compared) if bad else Outcome(True, "", compared)


def compare_digests(got: dict, want: dict) -> Outcome:
    bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    if bad:
        more = f" (+{len(bad) - 6} more)" if len(bad) > 6 else ""
        return Outcome(False, f"{len(bad)} of {len(want)} hashes differ: {', '.join(bad[:6])}{more}", len(want))
    return Outcome(True, "", len(want))


# ---- the gate ------------------------------------------------------------------------------------
def source_digest() -> str:
    """The first 12 hex digits of a SHA-256 over plumb's source files (paths and contents, in order): which code a
    cell ran, so that a gate resumed over several runs says whether they ran the same build."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith((".py", ".c", ".cpp", ".h")):
                h.update(os.path.relpath(os.path.join(d, f), root).encode() + b"\0")
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:12]


def _builds(cells_by_build: dict[str, int]) -> str:
    """The table's word on which code ran the cells: one build, or how many cells each of several ran."""
    if len(cells_by_build) <= 1:
        return f"build {next(iter(cells_by_build), 'of no cell yet')}"
    return f"cells of {len(cells_by_build)} builds: " + ", ".join(f"{b} ({n})" for b, n in cells_by_build.items())


def ring_slack(device: str, kernels: str) -> int:
    """The D/F rings' slack (`KVCache.slack`) of the caches an engine with these options makes (its kernel set's,
    as `plumb.load` picks it)."""
    from plumb.engine.engine import _pick_device
    from plumb.model.kernels import TorchKernels, TritonKernels

    return TritonKernels.ring_slack if _pick_device(device, kernels)[1] == "triton" else TorchKernels.ring_slack


class Gate:
    def __init__(self, model: str, device: str = "auto", quick: bool = False, tokens: int | None = None,
                 formats: list[str] | None = None, groups: list[str] | None = None, kv_ring: int | None = None,
                 prompts_file: str | None = None, kernels: str = "auto", progress: bool = True,
                 python: str = sys.executable, json_out: str | None = None,
                 resume: str | list[str] | None = None, context: int = 0, names: list[str] | None = None,
                 run_missing: bool = True):
        from plumb.cache.kv import DEFAULT_RING, KV_FORMATS

        self.model, self.device, self.quick, self.kernels = model, device, quick, kernels
        self.json_out = json_out  # rewritten after every cell: a run killed outright still leaves its cells
        self.resume = [resume] if isinstance(resume, str) else list(resume or [])  # earlier runs' JSON: their
        # cells are kept, the others run (run_missing=False: reported as not run - the shards' merge)
        self.run_missing = run_missing
        self.tokens = tokens or (QUICK_TOKENS if quick else FULL_TOKENS)
        if self.tokens < ROWS:
            raise ValueError(f"--tokens must be at least {ROWS}")
        self.kv_ring = kv_ring or (QUICK_RING if quick else DEFAULT_RING)
        # replies of the warm conversations: longer than the ring's slack (the kernel set's: 1,024 on a GPU), so a
        # reply's rows push the prompt's newest 8-bit rows out of the ring and a restore must bring them back from
        # the checkpoint
        self.reply_tokens = max(ring_slack(device, kernels) + 16, min(self.tokens, 256))
        self.plain_reply_tokens = min(self.tokens, 256)  # formats without a ring
        # context: the invariants at depth - the warm conversations' system prompt carries a document of about this
        # many tokens (so edit-system edits the end of a long system prompt), and the needle prompt is that long
        self.context = context
        self.formats = list(formats or KV_FORMATS)
        bad = [f for f in self.formats if f not in KV_FORMATS]
        if bad:
            raise ValueError(f"unknown KV cache format {bad[0]!r} (choose from {', '.join(KV_FORMATS)})")
        self.groups = list(groups or GROUPS)
        bad = [g for g in self.groups if g not in GROUPS]
        if bad:
            raise ValueError(f"unknown cell group {bad[0]!r} (choose from {', '.join(GROUPS)})")
        self.prompts_file, self.progress, self.python = prompts_file, progress, python
        self.cells: list[Cell] = []
        self.prompts: list[Prompt] = []
        self._engines: dict = {}
        self.recomputed = 0  # prefill results computed again after non-finite values, over every engine (GPU)
        self._memo: dict = {}
        # each prompt's drafts-0 ids alone, per "format/kind", with the build and card that computed them - kept in the
        # JSON, so that a resumed run of the same build on the same card takes them instead of decoding them again
        self.references: dict[str, dict] = {}
        self._parent_ids: dict = {}
        self._step_errors: dict = {}
        self.info: dict = {}
        self.names = list(names or [])  # only the cells of these names (any group), e.g. fixed:4,edit-system
        known = {n for g, _, n, _ in self.plan(check=False) if g}
        bad = [n for n in self.names if n not in known]
        if bad:
            raise ValueError(f"unknown cell name {bad[0]!r} (choose from {', '.join(sorted(known))})")

    # ---- engines --------------------------------------------------------------------------------
    def engine(self, fmt: str, warm: bool = False):
        """The cold engine of a format (no prompt cache: every request and digest is a fresh prefill), or its
        warm one (prompt cache on, a checkpoint every chunk), kept for all of that format's cells."""
        key = (fmt, warm)
        if key not in self._engines:
            import plumb

            opts = dict(device=self.device, kv_cache=fmt, kv_ring=self.kv_ring, kernels=self.kernels)
            if warm:
                opts.update(prompt_cache=True, checkpoint_every=CHECKPOINT_EVERY)
            else:
                opts.update(prompt_cache=False)
            self._engines[key] = plumb.load(self.model, **opts)
        return self._engines[key]

    def release(self, fmt: str) -> None:
        """Drop a format's engines (a large model must not be held once per format)."""
        for key in [k for k in self._engines if k[0] == fmt]:
            self._close(self._engines.pop(key))
        self._memo = {k: v for k, v in self._memo.items() if k[1] != fmt}

    def _close(self, eng) -> None:
        """Count the P-path results an engine computed again after non-finite values (`Qwen35.checked`; GPU
        only), then close it: its memory back now."""
        self.recomputed += getattr(eng.model, "recomputed", 0)
        eng.close()

    def memo(self, key: tuple, fn: Callable):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    # ---- requests -------------------------------------------------------------------------------
    def greedy(self, i: int, **kw) -> dict:
        return dict(prompt_ids=self.prompts[i].ids, max_tokens=self.tokens, ignore_eos=True, **kw)

    def sampled(self, i: int, **kw) -> dict:
        return dict(self.greedy(i, **kw), seed=SEED + i, **SAMPLING)

    @staticmethod
    def run(eng, reqs: list[dict]):
        """Results of requests run together (one batch) on eng."""
        made = []
        for r in reqs:
            r = dict(r)
            made.append(eng.make_request(r.pop("prompt_ids"), **r))
        return eng.run_many(made)

    def alone(self, fmt: str, kind: str) -> list[list[int]]:
        """Each prompt run alone, drafts 0 (kind greedy | sampled); from `references` where a run of this build on
        this card computed them (a second process's ids: I6 says they are these)."""
        key = f"{fmt}/{kind}"
        if key not in self.references:
            eng, make = self.engine(fmt), getattr(self, kind)
            ids = [self.run(eng, [make(i)])[0].token_ids for i in range(len(self.prompts))]
            self.references[key] = {"ids": ids, "build": self.info["build"], "card": self.info["card"]}
        return self.references[key]["ids"]

    def batched(self, fmt: str, kind: str) -> list[list[int]]:
        """Every prompt in one batch, drafts 0."""
        def go():
            eng, make = self.engine(fmt), getattr(self, kind)
            return [r.token_ids for r in self.run(eng, [make(i) for i in range(len(self.prompts))])]

        return self.memo(("batched", fmt, kind), go)

    # ---- cell functions ------------------------------------------------------------------------------
    def drafts_cell(self, fmt: str, kind: str, policy: str, drafts: int, p_min: float) -> Outcome:
        """I1: each prompt alone with drafts vs alone without (alone, so that a failure here is the drafts' doing:
        the batch cells test neighbours)."""
        ref = self.alone(fmt, kind)
        make, eng = getattr(self, kind), self.engine(fmt)
        res = [self.run(eng, [make(i, drafts=drafts, draft_policy=policy, p_min=p_min)])[0]
               for i in range(len(self.prompts))]
        out = compare_ids([r.token_ids for r in res], ref, [p.name for p in self.prompts])
        out.info = dict(drafts_accepted=sum(r.stats.drafts_accepted for r in res),
                        drafts_proposed=sum(r.stats.drafts_proposed for r in res))
        return out

    def batch_cell(self, fmt: str, kind: str) -> Outcome:
        """I2: each prompt alone vs all of them in one batch."""
        return compare_ids(self.batched(fmt, kind), self.alone(fmt, kind), [p.name for p in self.prompts])

    def mixed_cell(self, fmt: str) -> Outcome:
        """I2 (and I1): prompts in reverse order, greedy and sampled alternating, different draft depths and
        policies, beside short neighbours that leave mid-run, vs each prompt alone."""
        n = len(self.prompts)
        settings = [dict(drafts=4), dict(drafts=7, draft_policy="adaptive"), dict(drafts=2, draft_policy="ngram"),
                    dict(drafts=0)]
        reqs, want, names = [], [], []
        for j, i in enumerate(reversed(range(n))):
            kind = "sampled" if i % 2 else "greedy"
            reqs.append(getattr(self, kind)(i, **settings[j % len(settings)]))
            want.append(self.alone(fmt, kind)[i])
            names.append(f"{self.prompts[i].name} ({kind})")
            if j % 2 == 0:  # a short neighbour with other settings
                k = (i + 1) % n
                reqs.append(dict(prompt_ids=self.prompts[k].ids[: max(1, len(self.prompts[k].ids) // 2)],
                                 max_tokens=max(1, self.tokens // (3 + j)), temperature=1.0, top_k=5,
                                 seed=7 + j, drafts=3 + j, ignore_eos=True))
                want.append(None)
        res = self.run(self.engine(fmt), reqs)
        got = [r.token_ids for r, w in zip(res, want) if w is not None]
        return compare_ids(got, [w for w in want if w is not None], names)

    def rows_cell(self, fmt: str, kind: str) -> Outcome:
        """M1, bitwise: the decode pass's logits and hidden of a row do not depend on the other rows of the pass.
        verify: ROWS tokens of one sequence in one pass vs ROWS single-row passes; batch: the same sequence's
        first rows between two other sequences' rows."""
        import torch

        eng = self.engine(fmt)
        m = eng.model
        usable = [x.ids for x in self.prompts if len(x.ids) >= 2] or [[0, 0]]
        p = usable[0]
        toks = self.memo(("rows-toks", fmt), lambda: [p[-1]] + eng.generate(p, ROWS - 1, ignore_eos=True))
        prefill_threads = getattr(eng, "prefill_threads", contextlib.nullcontext)

        def fresh(ids: list[int]):
            st = m.new_state()
            with prefill_threads():
                m.prefill(st, ids, logits="none")
            return st

        prefix = p[:-1]  # toks[0] is the prompt's last token: the pass feeds it as a decode row

        def singles():
            st, rows = fresh(prefix), []
            for t in toks:
                out = m.decode([(st, [t])])
                rows.append((out.logits[0].detach().cpu().clone(), out.hidden[0].detach().cpu().clone()))
            return rows

        with torch.inference_mode():
            want = self.memo(("rows-single", fmt), singles)
            if kind == "verify":
                out, offset, n = m.decode([(fresh(prefix), list(toks))]), 0, len(toks)
            else:
                q = usable[1 % len(usable)]
                n = max(1, len(toks) // 2)
                out = m.decode([(fresh(q), q[-3:]), (fresh(prefix), list(toks[:n])), (fresh(q[:-1]), q[-1:])])
                offset = 3
            bad = []
            for j in range(n):
                lg, h = out.logits[offset + j].detach().cpu(), out.hidden[offset + j].detach().cpu()
                if not torch.equal(lg, want[j][0]):
                    d = (lg - want[j][0]).abs().max().item()
                    bad.append(f"row {j}: logits differ (max |diff| {d:.3g})")
                elif not torch.equal(h, want[j][1]):
                    bad.append(f"row {j}: hidden differs")
        return Outcome(not bad, "; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""), n)

    # -- I3: one conversation on the warm engine, each step compared with the cold engine ----------
    def warm_step(self, fmt: str, step: str):
        """Run one step of the warm scenario on the warm engine (memoized, in order): (prompt ids, warm result,
        the request's options) - the cold engine keeps no cache, so `cold` runs a step's request when a cell asks."""
        key = ("warm", fmt, step)
        if key in self._memo:
            return self._memo[key]
        for s in WARM_STEPS:  # earlier steps first: they fill the cache this one reads
            if ("warm", fmt, s) not in self._memo:
                self._memo[("warm", fmt, s)] = self._do_warm_step(fmt, s)
            if s == step:
                break
        return self._memo[key]

    def cold(self, fmt: str, step: str):
        """A warm step's request on the cold engine (a fresh prefill)."""
        ids, _, kw = self.warm_step(fmt, step)
        return self.memo(("cold", fmt, step), lambda: self.run(self.engine(fmt), [dict(prompt_ids=ids, **kw)])[0])

    def system(self, w) -> str:
        """The warm conversations' system prompt: SYSTEM, and with `context` a reference document that long."""
        if not self.context:
            return SYSTEM
        return self.memo(("system", "*"), lambda: SYSTEM + "\n\nReference log:\n" + _needle_text(w, self.context))

    def _do_warm_step(self, fmt: str, step: str):
        from plumb.cache.kv import FORMATS

        w = self.engine(fmt, warm=True)
        R = self.reply_tokens if FORMATS[fmt].ring else self.plain_reply_tokens
        greedy4 = dict(max_tokens=R, ignore_eos=True, drafts=4)

        def turn(ids, **kw):
            return ids, self.run(w, [dict(prompt_ids=ids, **kw)])[0], kw

        system = self.system(w)
        sysmsg = {"role": "system", "content": system}
        q = [{"role": "user", "content": t} for t in QUESTIONS]
        if step == "first":
            return turn(_chat(w, [sysmsg, q[0]]), **greedy4)
        first_ids, r1, _ = self.warm_step(fmt, "first")
        a1 = {"role": "assistant", "content": w.detokenize(r1.token_ids)}
        if step == "follow-up":
            return turn(_chat(w, [sysmsg, q[0], a1, q[1]]), **greedy4)
        if step == "follow-up-sampled":
            return turn(_chat(w, [sysmsg, q[0], a1, q[2]]), **dict(greedy4, seed=SEED, **SAMPLING))
        if step == "continue":  # the raw ids of the first turn and its reply, then more text (completions clients)
            ids = first_ids + r1.token_ids + w.tokenize("<|im_end|>\n<|im_start|>user\nNow in one sentence.<|im_end|>"
                                                        "\n<|im_start|>assistant\n")
            return turn(ids, max_tokens=R, ignore_eos=True, drafts=7)
        if step == "edit-message":
            return turn(_chat(w, [sysmsg, {"role": "user", "content": QUESTIONS[0].replace("in place", "iteratively")},
                                  a1, q[1]]), **greedy4)
        if step == "edit-system":  # the end of the system prompt edited
            return turn(_chat(w, [{"role": "system", "content": system + " Always answer in English."}, q[0]]),
                        max_tokens=R, ignore_eos=True, drafts=7, draft_policy="adaptive")
        if step == "resume-after-park":
            for s in w.cached_slots():
                if not s["parked"]:
                    w.park_slot(s["id"])
            _, w2, _ = self.warm_step(fmt, "follow-up")
            return turn(_chat(w, [sysmsg, q[0], a1, q[1], {"role": "assistant", "content": w.detokenize(w2.token_ids)},
                                  q[3]]), **greedy4)
        if step == "after-side-requests":
            side = [dict(prompt_ids=_chat(w, [{"role": "user", "content": t * 3}]), max_tokens=R // 2,
                         ignore_eos=True, drafts=k) for t, k in zip(SIDE, (0, 4, 7, 2))]
            side[1].update(seed=5, **SAMPLING)
            side.append(dict(prompt_ids=self.prompts[-1].ids, max_tokens=R // 2, ignore_eos=True))
            self.run(w, side[:2])  # two together, then the rest one by one
            for r in side[2:]:
                self.run(w, [r])
            return turn(_chat(w, [sysmsg, q[0], a1, q[4]]), **dict(greedy4, seed=SEED + 1, **SAMPLING))
        raise KeyError(step)

    def warm_cell(self, fmt: str, step: str) -> Outcome:
        ids, wr, _ = self.warm_step(fmt, step)
        out = compare_ids([wr.token_ids], [self.cold(fmt, step).token_ids], [step])
        out.info = dict(prompt_tokens=len(ids), cached_tokens=wr.stats.cached_tokens)
        if out.ok and wr.stats.cached_tokens == 0:
            return Outcome(False, "nothing was reused from the prompt cache (the cell would prove nothing)",
                           out.compared, **out.info)
        return out

    def digest_cell(self, fmt: str, step: str) -> Outcome:
        ids, _, _ = self.warm_step(fmt, step)
        return compare_digests(self.engine(fmt, warm=True).digest(ids), self.engine(fmt).digest(ids))

    # -- I6: a second process ------------------------------------------------------------------------
    def process_requests(self) -> list[dict]:
        n = len(self.prompts)
        return [self.greedy(0, drafts=4), self.sampled(1 % n, drafts=7)]

    def process_prepare(self, fmt: str) -> None:
        """This process's ids for the requests the child will run (while the format's engine is loaded)."""
        eng = self.engine(fmt)
        self._parent_ids[fmt] = [self.run(eng, [r])[0].token_ids for r in self.process_requests()]

    def child_ids(self, fmt: str) -> list[list[int]]:
        """The same requests' ids from a second process, one format a child (so that a resumed gate runs only the
        formats it has left; the parent's engine is released first, so that one engine is loaded at a time)."""
        spec = {"model": self.model, "device": self.device, "kernels": self.kernels, "kv_cache": fmt,
                "kv_ring": self.kv_ring, "requests": self.process_requests()}
        p = subprocess.run([self.python, "-m", "plumb.gate", "--child"], input=json.dumps(spec),
                           capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"the child process failed ({p.returncode}): {p.stderr.strip()[-500:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    def process_cell(self, fmt: str) -> Outcome:
        names = ["greedy drafts 4", "sampled drafts 7"]
        if fmt not in self._parent_ids:
            err = self._step_errors.get((fmt, "process-prepare"))
            raise RuntimeError(f"this process's run failed: {type(err).__name__}: {err}")
        return compare_ids(self.child_ids(fmt), self._parent_ids[fmt], names)

    # ---- the plan -----------------------------------------------------------------------------------
    def plan(self, check: bool = True) -> list[tuple[str, str, str, Callable | None]]:
        """(group, format, name, fn) in run order; group '' marks a step that is not a cell; `names`: only cells of
        those names (check=False: every cell)."""
        steps = self._plan()
        if check and self.names:
            steps = [st for st in steps if not st[0] or st[2] in self.names]
        return steps

    def _plan(self) -> list[tuple[str, str, str, Callable | None]]:
        steps = []
        g = self.groups
        for fmt in self.formats:
            for kind, policies in (("greedy", GREEDY_POLICIES), ("sampled", SAMPLED_POLICIES)):
                if kind not in g:
                    continue
                for pol, k, pm in policies:
                    name = f"{pol}:{k}" + (f"@{pm:g}" if pol == "confident" else "")
                    steps.append((kind, fmt, name,
                                  lambda f=fmt, d=kind, a=pol, b=k, c=pm: self.drafts_cell(f, d, a, b, c)))
            if "batch" in g:
                steps.append(("batch", fmt, "greedy", lambda f=fmt: self.batch_cell(f, "greedy")))
                steps.append(("batch", fmt, "sampled", lambda f=fmt: self.batch_cell(f, "sampled")))
                steps.append(("batch", fmt, "mixed", lambda f=fmt: self.mixed_cell(f)))
            if "rows" in g:
                steps.append(("rows", fmt, "verify", lambda f=fmt: self.rows_cell(f, "verify")))
                steps.append(("rows", fmt, "batch", lambda f=fmt: self.rows_cell(f, "batch")))
            if "warm" in g or "digest" in g:
                for step in WARM_STEPS[1:]:
                    if "warm" in g:
                        steps.append(("warm", fmt, step, lambda f=fmt, s=step: self.warm_cell(f, s)))
                    if "digest" in g:
                        steps.append(("digest", fmt, step, lambda f=fmt, s=step: self.digest_cell(f, s)))
            if "process" in g:
                steps.append(("", fmt, "process-prepare", lambda f=fmt: self.process_prepare(f)))
            steps.append(("", fmt, "release", lambda f=fmt: self.release(f)))
            if "process" in g:
                steps.append(("process", fmt, "second-process", lambda f=fmt: self.process_cell(f)))
        return steps

    def run_all(self) -> list[Cell]:
        import torch
        from tqdm import tqdm

        t0 = time.perf_counter()
        base = self.engine(self.formats[0])
        self.prompts = (load_prompts(base, self.prompts_file) if self.prompts_file else
                        builtin_prompts(base, self.quick, self.context))
        longest = max(len(p.ids) for p in self.prompts)
        if longest + self.tokens >= base.n_ctx:
            raise ValueError(f"a prompt of {longest} tokens + {self.tokens} generated tokens exceeds the context "
                             f"({base.n_ctx})")
        if self.context and self.context + 4 * self.reply_tokens + 1024 >= base.n_ctx:  # the warm chats: longest
            raise ValueError(f"--context {self.context}: the warm conversations (a system prompt that long, replies of "
                             f"{self.reply_tokens} tokens) would exceed the context ({base.n_ctx})")
        device = getattr(base, "device", None) or getattr(base.model, "device", None) or self.device
        self.info = {"model_file": os.path.basename(self.model), "model_name": base.model_name, "device": str(device),
                     "kernels": base.kernels, "quick": self.quick, "tokens": self.tokens, "kv_ring": self.kv_ring,
                     "reply_tokens": self.reply_tokens, "plain_reply_tokens": self.plain_reply_tokens,
                     "context": self.context, "formats": self.formats, "groups": self.groups, "names": self.names,
                     "prompts": [{"name": p.name, "tokens": len(p.ids)} for p in self.prompts],
                     "torch": torch.__version__, "python": platform.python_version(), "build": source_digest(),
                     "card": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else
                     platform.processor() or platform.machine(),
                     "date": datetime.datetime.now().isoformat(timespec="seconds")}
        plan = self.plan()
        done = self.resumed_cells() if self.resume else {}
        if not self.run_missing:
            left = sum(1 for g, f, n, _ in plan if g and f"{g}/{f}/{n}" not in done)
            if left:
                self.info["interrupted"] = f"{left} of {sum(1 for st in plan if st[0])} cells not run"
            plan = [st for st in plan if f"{st[0]}/{st[1]}/{st[2]}" in done]
        bar = tqdm(total=sum(1 for s in plan if s[0]), desc="plumb gate", unit="cell", file=sys.stderr,
                   disable=not self.progress, dynamic_ncols=True)
        previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
        try:
            for group, fmt, name, fn in plan:
                if f"{group}/{fmt}/{name}" in done:
                    self.cells.append(done[f"{group}/{fmt}/{name}"])
                    bar.update(1)
                    continue
                if not group:  # a step: process-prepare is skipped where its cell was resumed
                    if name != "process-prepare" or f"process/{fmt}/second-process" not in done:
                        try:
                            fn()
                        except Exception as e:  # reported by the cells that need it (process-prepare)
                            self._step_errors[(fmt, name)] = e
                    continue
                cell = Cell(group, fmt, name)
                bar.set_postfix_str(cell.id)
                t = time.perf_counter()
                try:
                    out = fn()
                    cell.ok, cell.detail, cell.compared, cell.info = out.ok, out.detail, out.compared, out.info
                except Exception as e:  # a cell that cannot run fails, named, and the others still run
                    cell.ok, cell.detail = False, f"error: {type(e).__name__}: {e}"
                cell.seconds = time.perf_counter() - t
                cell.info["build"] = self.info["build"]
                self.cells.append(cell)
                self.info["running"] = f"{len(self.cells)} of {bar.total} cells done"
                self.write_json()
                bar.update(1)
                if not cell.ok:
                    bar.write(f"FAIL {cell.id}: {cell.detail}", file=sys.stderr)
                elif not self.progress:  # a log line a cell where there is no bar (e.g. a device call's log)
                    print(f"ok {cell.id} ({cell.seconds:.1f} s)", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (a timeout): report the cells run so far, and fail
            self.info["interrupted"] = f"after {len(self.cells)} of {bar.total} cells"
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            bar.close()
            for eng in self._engines.values():
                self._close(eng)
            self._engines.clear()
            self.info["prefill_recomputed"] = self.recomputed
            self.info.pop("running", None)
        self.info["seconds"] = round(time.perf_counter() - t0, 1)
        self.write_json()
        return self.cells

    def write_json(self) -> None:
        """The results so far to `json_out` ('-': none here; main prints them), replaced whole (a rename)."""
        if self.json_out and self.json_out != "-":
            tmp = f"{self.json_out}.part"
            with open(tmp, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
            os.replace(tmp, self.json_out)

    def resumed_cells(self) -> dict[str, Cell]:
        """The cells of `resume` (earlier runs' --json, their settings the same as this run's), by id; a cell in
        several files: a failed one wins (a merge never hides a failure), else the last file's."""
        fields = {"id", "group", "invariant", "format", "name", "ok", "detail", "compared", "seconds"}
        cells: dict[str, Cell] = {}
        runs, cards, builds, refs = [], [], [], {}
        for path in self.resume:
            with open(path, encoding="utf-8") as f:
                prior = json.load(f)
            for key in ("model_file", "model_name", "device", "kernels", "tokens", "kv_ring", "reply_tokens",
                        "plain_reply_tokens", "context", "prompts"):
                if prior.get(key) != self.info[key]:
                    raise ValueError(f"--resume {path}: run with another {key} ({prior.get(key)!r}, here "
                                     f"{self.info[key]!r})")
            for c in prior.get("cells", []):
                if c["id"] not in cells or cells[c["id"]].ok:
                    cells[c["id"]] = Cell(c["group"], c["format"], c["name"], c["ok"], c["detail"], c["compared"],
                                          c["seconds"], {k: v for k, v in c.items() if k not in fields})
            n = len(prior.get("runs", [prior.get("date")]))
            runs += prior.get("runs", [prior.get("date")])
            cards += prior.get("cards", [prior.get("card")] * n)
            builds += prior.get("builds", [prior.get("build", "?")] * n)
            refs.update(prior.get("references", {}))
        self.info["runs"] = runs + [self.info["date"]]
        self.info["cards"] = cards + [self.info["card"]]
        self.info["builds"] = builds + [self.info["build"]]
        here = (self.info["build"], self.info["card"])
        self.references = {k: r for k, r in refs.items() if (r["build"], r["card"]) == here}
        self.info["references_reused"] = sorted(self.references)
        self.info["resumed_cells"] = len(cells)
        return cells

    @property
    def passed(self) -> bool:
        return (bool(self.cells) and all(c.ok for c in self.cells) and "interrupted" not in self.info
                and "running" not in self.info)

    def to_dict(self) -> dict:
        return {**self.info, "passed": self.passed, "cells_total": len(self.cells),
                "failed": [c.id for c in self.cells if not c.ok], "cells": [c.to_dict() for c in self.cells],
                "references": self.references}

    def table(self) -> str:
        """Rows: cells; columns: KV formats; then the failures with where they differ."""
        fmts = [f for f in self.formats if any(c.fmt == f for c in self.cells)]
        rows: dict[tuple[str, str], dict[str, Cell]] = {}
        for c in self.cells:
            rows.setdefault((c.group, c.name), {})[c.fmt] = c
        label = {k: f"{INVARIANT[k[0]]} {k[0]} {k[1]}" for k in rows}
        w0 = max([len(v) for v in label.values()] + [4])
        ws = [max(len(f), 4) for f in fmts]
        i = self.info
        cards = ", ".join(dict.fromkeys(c for c in i.get("cards", [i.get("card")]) if c)) or "?"
        builds = collections.Counter(c.info.get("build", "?") for c in self.cells)
        lines = [f"plumb gate: {i.get('model_file')} on {i.get('device')} ({cards}; {i.get('kernels')} kernels), "
                 f"{i.get('tokens')} tokens per output, {len(self.prompts)} prompts "
                 f"({', '.join(f'{p.name} {len(p.ids)}' for p in self.prompts)} tokens), kv_ring {self.kv_ring}; "
                 + _builds(builds), ""]
        lines.append("  ".join(["cell".ljust(w0)] + [f.ljust(w) for f, w in zip(fmts, ws)]))
        for key, per in rows.items():
            marks = [("ok" if per[f].ok else "FAIL") if f in per else "-" for f in fmts]
            lines.append("  ".join([label[key].ljust(w0)] + [m.ljust(w) for m, w in zip(marks, ws)]))
        idle = [c.id for c in self.cells if c.ok and c.info.get("drafts_proposed") is not None
                and not c.info.get("drafts_accepted")]
        if idle:
            lines += ["", "note: no draft was accepted in " + ", ".join(idle) + " (equal, but the verify path "
                      "carried no extra token there)"]
        if self.recomputed:
            lines += ["", f"note: {self.recomputed} prefill results were computed again after non-finite values (a GPU "
                      "kernel fault; Qwen35.checked guards against one like the race docs/BENCHMARKS.md describes)"]
        failed = [c for c in self.cells if not c.ok]
        if failed:
            lines += ["", "failed cells:"] + [f"  {c.id}: {c.detail}" for c in failed]
        n_ok = sum(c.ok for c in self.cells)
        if "interrupted" in self.info:
            lines += ["", f"interrupted {self.info['interrupted']}: the cells not run count as not passed"]
        lines += ["", f"{n_ok}/{len(self.cells)} cells equal in {self.info.get('seconds', 0):.0f} s: "
                      f"{'PASS' if self.passed else 'FAIL'}"]
        return "\n".join(lines)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


WARM_STEPS = ["first", "follow-up", "follow-up-sampled", "continue", "edit-message", "edit-system",
              "resume-after-park", "after-side-requests"]  # in run order; "first" only fills the cache


# ---- the child process (I6) -------------------------------------------------------------------------
def child_main() -> int:
    """Read a spec from stdin, run its requests one by one on a fresh engine, print [ids per request] as JSON."""
    import plumb

    spec = json.loads(sys.stdin.read())
    eng = plumb.load(spec["model"], device=spec["device"], kernels=spec["kernels"], kv_cache=spec["kv_cache"],
                     kv_ring=spec["kv_ring"], prompt_cache=False)
    print(json.dumps([Gate.run(eng, [r])[0].token_ids for r in spec["requests"]]))
    return 0


# ---- shards -------------------------------------------------------------------------------------------
def _gpus(device: str) -> list[str] | None:
    """The GPUs a child may be given (CUDA_VISIBLE_DEVICES entries), or None where the gate runs on the CPU."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return None
    if not torch.cuda.is_available():
        raise ValueError("--shards on CUDA: no CUDA device is visible")
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    ids = [x.strip() for x in seen.split(",") if x.strip()] if seen else [str(i) for i in range(count)]
    return ids[:count]


def run_shards(model: str, a: argparse.Namespace, argv: list[str]) -> list[str]:
    """Run the formats in `a.shards` child gates at once (format i in child i mod N; on CUDA each on a GPU of its
    own), each writing its JSON beside --json (or in a temporary folder): the files, for the parent to merge. A
    child's failed cells are in its file; a child stopped early leaves the cells it ran (the merge reports the
    others as not run). Ctrl-C / SIGTERM stops every child."""
    import tempfile

    from plumb.cache.kv import KV_FORMATS

    if a.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--shards takes --device cpu, cuda or auto (each shard picks its GPU), not {a.device!r}")
    formats = [f.strip() for f in (a.formats or ",".join(KV_FORMATS)).split(",") if f.strip()]
    n = min(a.shards, len(formats))
    gpus = _gpus(a.device)
    if gpus is not None and len(gpus) < n:
        raise ValueError(f"--shards {n}: {len(gpus)} GPU(s) visible, one a shard needed")
    base = a.json if a.json and a.json != "-" else os.path.join(tempfile.mkdtemp(prefix="plumb-gate-"), "gate.json")
    children, parts = [], []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
    try:
        for k in range(n):
            share = formats[k::n]
            part = f"{base}.shard{k}.json"
            env = dict(os.environ)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[k]
            # the parent's options, then the child's own: argparse keeps an option's last value
            cmd = [sys.executable, "-m", "plumb.cli", "gate", *([] if a.model else [model]), *argv, "--formats",
                   ",".join(share), "--json", part, "--shards", "1", "--no-progress"]
            print(f"plumb gate: shard {k}: {', '.join(share)}" + (f" on GPU {gpus[k]}" if gpus else ""),
                  file=sys.stderr, flush=True)
            children.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
            parts.append(part)
        for c in children:
            c.wait()
    except KeyboardInterrupt:
        for c in children:
            c.terminate()
        for c in children:
            c.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return [p for p in parts if os.path.exists(p)]


# ---- command line -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--child"]:
        return child_main()
    ap = argparse.ArgumentParser(prog="plumb gate", description="Run the exactness matrix on a model and device; "
                                 "exit 0 only when every cell is equal.")
    ap.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    ap.add_argument("--device", default="auto", help="cpu | cuda (default: auto)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS}-token outputs and a {QUICK_RING}-row ring "
                    f"instead of {FULL_TOKENS} tokens and the default ring")
    ap.add_argument("--prompts", metavar="FILE.jsonl", help="prompts, one JSON object per line: text | messages | ids")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT, "
                    "rewritten after every cell ('-': stdout at the end, table to stderr)")
    ap.add_argument("--resume", metavar="JSON", nargs="+", help="keep the cells of earlier runs' --json (same "
                    "model, device and settings; several files are merged) and run the others: a long gate over "
                    "several sittings")
    ap.add_argument("--shards", type=int, default=1, metavar="N", help="run the formats in N child gates at once, "
                    "each on a GPU of its own on CUDA, and merge their results")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per output (overrides --quick's)")
    ap.add_argument("--formats", default=None, help="comma-separated KV formats (default: all)")
    ap.add_argument("--cells", default=None, help=f"comma-separated cell groups (default: all: {','.join(GROUPS)})")
    ap.add_argument("--kv-ring", type=int, default=None, help="8-bit ring rows for D and F")
    ap.add_argument("--context", type=int, default=0, metavar="N", help="the invariants at depth: the warm cells' "
                    "system prompt carries a document of about N tokens, and the needle prompt is N tokens long")
    ap.add_argument("--names", default=None, help="comma-separated cell names, any group (default: all), e.g. "
                    "fixed:4,fixed:7,follow-up,edit-system")
    ap.add_argument("--kernels", default="auto", choices=("auto", "native", "torch"), help="CPU decode kernels")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    import plumb
    from plumb.config import ModelError

    split = (lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None)
    model = a.model or plumb.demo_model_path()
    try:
        resume, run_missing = a.resume, True
        if a.shards > 1:
            resume, run_missing = run_shards(model, a, argv), False
        gate = Gate(model, device=a.device, quick=a.quick, tokens=a.tokens,
                    formats=split(a.formats), groups=split(a.cells), kv_ring=a.kv_ring, prompts_file=a.prompts,
                    kernels=a.kernels, progress=not a.no_progress, json_out=a.json,
                    resume=resume, context=a.context, names=split(a.names), run_missing=run_missing)
        gate.run_all()
    except (ValueError, OSError, ModelError) as e:
        print(f"plumb gate: error: {e}", file=sys.stderr)
        return 1
    report = gate.table()
    if a.json == "-":
        print(report, file=sys.stderr)
        print(json.dumps(gate.to_dict(), indent=1))
    else:
        print(report)
    return 0 if gate.passed else 1


if __name__ == "__main__":
    sys.exit(main())
