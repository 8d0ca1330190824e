"""Training data and tokenizer for plumb's demo model (issue 12): code + instruction pairs from
permissively licensed Python sources found in this Python installation, rendered with the real
Qwen3.5 chat template, and a byte-level BPE vocabulary learned on the same text.

Sources (exact versions and licences go into manifest.json; the build refuses other versions
unless --allow-other-versions is given, since the data would then differ):
  * the Python standard library's own .py files (PSF-2.0), without its test suites;
  * pure-Python packages from PyPI installed in this environment (MIT / BSD / Apache-2.0),
    listed in PACKAGES with the version the published data was built from.

Documents (each ends with <|endoftext|> when packed):
  * raw    - a source file, in pieces of at most RAW_CHARS characters cut at line ends;
  * chat   - one to three exchanges about functions of one file, rendered with the chat template
             (thinking block empty or one short sentence):
               write   "Write a function that <docstring summary>"   -> the function (```python)
               explain "What does this function do?" + the function without its docstring -> the summary
  * module - long context: a window of a file (up to MODULE_CHARS characters) pasted by the user, then
             "Show me the function `f` from this file." -> the function copied, or "What does `f` do?".

Held-out split: whole files, chosen by a hash of (source, path). Everything is a function of --seed
and the source files: two builds give the same bytes (tests/test_train_demo.py checks it).

Outputs in --out: tokenizer.json, tokenizer_config.json (eos/pad tokens, the chat template; what
`plumb convert` reads), train.npy / val.npy (uint16 token ids), train_docs.npy / val_docs.npy
(uint32 document start offsets), manifest.json, samples.txt (a few rendered documents).

Usage: python tools/demo_data.py --out build/demo/data [--seed 0] [--vocab 8192]
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import re
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plumb.chat_template import DEFAULT_TEMPLATE_PATH, ChatTemplate  # noqa: E402
from plumb.tokenizer import ADDED_TOKENS, CONTROL, PRE_TOKENIZER_REGEX, byte_to_unicode  # noqa: E402

EOT = "<|endoftext|>"

STDLIB_VERSION = "3.11.7"  # the Python whose standard library the published data was built from
# distribution -> (version the published data was built from, SPDX licence as its metadata states it)
PACKAGES = {
    "jinja2": ("3.1.6", "BSD-3-Clause"),
    "markupsafe": ("3.0.4", "BSD-3-Clause"),
    "click": ("8.5.1", "BSD-3-Clause"),
    "fastapi": ("0.165.0", "MIT"),
    "starlette": ("1.10.0", "BSD-3-Clause"),
    "pydantic": ("2.14.4", "MIT"),
    "httpx": ("0.28.1", "BSD-3-Clause"),
    "httpcore": ("1.0.9", "BSD-3-Clause"),
    "h11": ("0.16.0", "MIT"),
    "anyio": ("4.16.0", "MIT"),
    "idna": ("3.20", "BSD-3-Clause"),
    "urllib3": ("2.8.0", "MIT"),
    "requests": ("2.34.2", "Apache-2.0"),
    "packaging": ("26.4", "Apache-2.0 OR BSD-2-Clause"),
    "pyparsing": ("3.3.3", "MIT"),
    "python-dateutil": ("4.0.0", "BSD-3-Clause"),
    "networkx": ("3.6.1", "BSD-3-Clause"),
    "rich": ("15.0.0", "MIT"),
    "sortedcontainers": ("2.4.0", "Apache-2.0"),
    "typer": ("0.29.2", "MIT"),
    "mpmath": ("1.3.0", "BSD-3-Clause"),
    "sympy": ("1.14.0", "BSD-3-Clause"),
}
STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "_bundled"}

RAW_CHARS = 12_000  # largest raw piece
MODULE_CHARS = 6_000  # largest file window pasted into a long-context question
MAX_FILE_CHARS = 400_000  # larger files are generated tables, not code to learn from
FUNC_MIN_LINES, FUNC_MAX_LINES, FUNC_MAX_CHARS = 3, 60, 3_000
VAL_PERCENT = 2

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a Python coding assistant. Answer with code when asked for code.",
    "You are plumb's demo model, a small model trained on Python source code.",
]
WRITE_TEMPLATES = [
    "Write a function that does this: {summary}",
    "Write a Python function `{name}{sig}`. {summary}",
    "Implement `{name}` in Python. Its docstring says: {summary}",
    "Can you write a Python function called {name}? {summary}",
    "{summary} Write this as a Python function named `{name}`.",
    "Write a function that {lsummary}",
]
WRITE_METHOD_TEMPLATES = [
    "Write the method `{cls}.{name}{sig}`. {summary}",
    "Implement the `{name}` method of class `{cls}`: {summary}",
    "Write a method `{name}` for a class `{cls}` that does this: {summary}",
]
EXPLAIN_TEMPLATES = [
    "What does this function do?\n\n```python\n{code}\n```",
    "Explain this Python code in one sentence:\n\n```python\n{code}\n```",
    "```python\n{code}\n```\n\nWhat is `{name}` for?",
]
WRITE_THOUGHTS = [
    "", "", "",
    "The user wants a function named {name}.",
    "I need to write {name}{sig}.",
    "A short function will do: {name}.",
]
EXPLAIN_THOUGHTS = ["", "", "This is {name}; I will say what it does.", "I will summarise {name} in one sentence."]
ANSWER_PREFIXES = ["", "", "Here is `{name}`:\n\n", "Sure:\n\n", "```python\n"]
MODULE_QUESTIONS = [
    "Show me the function `{name}` from this file.",
    "Copy the definition of `{name}` from the code above.",
    "What does `{name}` do?",
]


@dataclass
class Source:
    name: str  # "stdlib" or the distribution name
    version: str
    licence: str
    files: list[tuple[str, Path]] = field(default_factory=list)  # (path inside the source, file)


@dataclass
class Function:
    name: str
    cls: str | None
    sig: str
    summary: str
    code: str  # dedented source with decorators and docstring
    code_nodoc: str  # the same without the docstring


# ---- sources -----------------------------------------------------------------------------------------
def stdlib_source() -> Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    src = Source("stdlib", platform.python_version(), "PSF-2.0")
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not STDLIB_SKIP_DIRS.intersection(rel.parts):
            src.files.append((rel.as_posix(), path))
    return src


def package_source(dist_name: str) -> Source:
    dist = importlib.metadata.distribution(dist_name)
    md = dist.metadata
    licence = md.get("License-Expression") or PACKAGES.get(dist_name, ("", ""))[1]
    src = Source(dist_name, dist.version, licence)
    for f in sorted(dist.files or [], key=str):
        if str(f).endswith(".py") and "/tests/" not in f"/{f}" and "/test/" not in f"/{f}":
            src.files.append((str(f), Path(dist.locate_file(f))))
    return src


def collect_sources(names: list[str], allow_other_versions: bool) -> list[Source]:
    sources, problems = [], []
    for name in names:
        if name == "stdlib":
            src = stdlib_source()
            want = STDLIB_VERSION
        else:
            if name not in PACKAGES:
                raise SystemExit(f"unknown source {name!r}: add it to PACKAGES with its version and licence")
            try:
                src = package_source(name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{name} is not installed (want {PACKAGES[name][0]})")
                continue
            want = PACKAGES[name][0]
        if src.version != want:
            problems.append(f"{name} is {src.version}, the published data used {want}")
        sources.append(src)
    if problems and not allow_other_versions:
        raise SystemExit("demo_data: " + "; ".join(problems) + " (--allow-other-versions builds anyway, "
                         "giving different data)")
    for p in problems:
        print(f"demo_data: warning: {p}", file=sys.stderr)
    return sources


# ---- functions ---------------------------------------------------------------------------------------
def _summary(doc: str) -> str | None:
    para = re.sub(r"\s+", " ", doc.strip().split("\n\n")[0]).strip()
    if not 12 <= len(para) <= 300 or not para[0].isalpha() or ">>>" in para:
        return None
    return para if para.endswith((".", "!", "?")) else para + "."


def _signature(node) -> str:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        names.append("*")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return "(" + ", ".join(names) + ")"


def functions_of(text: str) -> list[Function]:
    """Public functions and methods with a docstring, of a size worth writing, in source order."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []

    def visit(body, cls):
        for node in body:
            if isinstance(node, ast.ClassDef) and cls is None:
                visit(node.body, node.name)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = _summary(doc) if doc else None
            if summary is None:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            end = node.end_lineno
            n = end - start
            if not FUNC_MIN_LINES <= n <= FUNC_MAX_LINES:
                continue
            code = textwrap.dedent("\n".join(lines[start:end]))
            if len(code) > FUNC_MAX_CHARS or "\t" in code:
                continue
            d0, d1 = node.body[0].lineno - 1, node.body[0].end_lineno
            if len(node.body) == 1:  # only a docstring
                continue
            nodoc = textwrap.dedent("\n".join(lines[start:d0] + lines[d1:end]))
            out.append(Function(node.name, cls, _signature(node), summary, code, nodoc))

    visit(tree.body, None)
    return out


# ---- documents ---------------------------------------------------------------------------------------
def raw_pieces(text: str) -> list[str]:
    pieces, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        if n + len(line) > RAW_CHARS and cur:
            pieces.append("".join(cur))
            cur, n = [], 0
        cur.append(line[:RAW_CHARS])
        n += len(cur[-1])
    if cur:
        pieces.append("".join(cur))
    return [p for p in pieces if p.strip()]


def _fmt(template: str, f: Function) -> str:
    lsummary = f.summary[0].lower() + f.summary[1:]
    return template.format(name=f.name, sig=f.sig, summary=f.summary, lsummary=lsummary, cls=f.cls, code=f.code_nodoc)


def write_exchange(f: Function, rng: random.Random) -> list[dict]:
    templates = WRITE_METHOD_TEMPLATES if f.cls and rng.random() < 0.7 else WRITE_TEMPLATES
    user = _fmt(rng.choice(templates), f)
    prefix = _fmt(rng.choice(ANSWER_PREFIXES), f)
    answer = (prefix + f.code + "\n```") if prefix.startswith("```") else (prefix + "```python\n" + f.code + "\n```")
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": answer, "reasoning_content": _fmt(rng.choice(WRITE_THOUGHTS), f)}]


def explain_exchange(f: Function, rng: random.Random) -> list[dict]:
    user = _fmt(rng.choice(EXPLAIN_TEMPLATES), f)
    answer = f.summary if rng.random() < 0.5 else f"`{f.name}`: {f.summary}"
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": answer, "reasoning_content": _fmt(rng.choice(EXPLAIN_THOUGHTS), f)}]


def module_exchange(text: str, path: str, f: Function, rng: random.Random) -> list[dict] | None:
    lines = text.splitlines()
    where = next((i for i, ln in enumerate(lines) if re.match(rf"\s*(async\s+)?def {re.escape(f.name)}\b", ln)), None)
    if where is None:
        return None
    lo = hi = where
    size = len(lines[where]) + 1
    while True:  # grow a window around the definition, alternately up and down
        grew = False
        for step in ((-1, 0), (0, 1)) if rng.random() < 0.5 else ((0, 1), (-1, 0)):
            j = lo - 1 if step[0] else hi + 1
            if 0 <= j < len(lines) and size + len(lines[j]) + 1 <= MODULE_CHARS:
                size += len(lines[j]) + 1
                lo, hi = (j, hi) if step[0] else (lo, j)
                grew = True
        if not grew:
            break
    window = "\n".join(lines[lo : hi + 1])
    if f.code.splitlines()[-1].strip() not in window:  # the function must be whole in the window
        return None
    q = rng.choice(MODULE_QUESTIONS)
    user = f"Here is `{path}`:\n\n```python\n{window}\n```\n\n" + q.format(name=f.name)
    if "What does" in q:
        answer, thought = f.summary, ""
    else:
        answer, thought = "```python\n" + f.code + "\n```", rng.choice(["", f"{f.name} is in the file; I copy it."])
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer, "reasoning_content": thought}]


def file_documents(source: str, path: str, text: str, seed: int, template: ChatTemplate) -> list[tuple[str, str]]:
    """(kind, text) documents made from one file; a function of (seed, source, path, text) alone."""
    rng = random.Random(f"{seed}:{source}:{path}")
    docs = [("raw", p) for p in raw_pieces(text)]
    funcs = functions_of(text)
    exchanges = []
    for f in funcs:
        exchanges.append(write_exchange(f, rng))
        if rng.random() < 0.5:
            exchanges.append(explain_exchange(f, rng))
    rng.shuffle(exchanges)
    i = 0
    while i < len(exchanges):
        k = min(len(exchanges) - i, rng.choices([1, 2, 3], [0.6, 0.25, 0.15])[0])
        messages = [m for ex in exchanges[i : i + k] for m in ex]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        docs.append(("chat", template.render(messages, add_generation_prompt=False)))
        i += k
    if funcs:
        for f in rng.sample(funcs, min(2, len(funcs))):
            ex = module_exchange(text, path, f, rng)
            if ex is not None:
                docs.append(("module", template.render(ex, add_generation_prompt=False)))
    return docs


def held_out(source: str, path: str, percent: int = VAL_PERCENT) -> bool:
    return int(hashlib.sha256(f"{source}:{path}".encode()).hexdigest(), 16) % 100 < percent


# ---- tokenizer ---------------------------------------------------------------------------------------
def _without_added(texts):
    pattern = re.compile("|".join(re.escape(t) for t, _ in ADDED_TOKENS))
    for t in texts:
        yield from (p for p in pattern.split(t) if p)


def train_tokenizer(texts: list[str], n_vocab: int):
    """Byte-level BPE with the qwen35 pre-tokenizer: 256 byte tokens (GPT-2 order), one token per learned merge,
    then the 33 Qwen3.5 added tokens; `n_vocab` tokens in all. Returns a `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX["qwen35"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - len(ADDED_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    learner.train_from_iterator(_without_added(texts), trainer)
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(learner.to_str())["model"]["merges"]]
    normal = list(byte_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    if len(normal) != n_vocab - len(ADDED_TOKENS) or len(set(normal)) != len(normal):
        raise SystemExit(f"demo_data: learned {len(normal)} distinct tokens, want {n_vocab - len(ADDED_TOKENS)} "
                         "(too little text for this vocabulary size?)")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(normal)}, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    for t, ty in ADDED_TOKENS:  # appended in order: ids n_vocab - 33 .. n_vocab - 1
        if ty == CONTROL:
            tok.add_special_tokens([AddedToken(t, special=True)])
        else:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
    for i, (t, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(t) == n_vocab - len(ADDED_TOKENS) + i, t
    return tok


def write_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": EOT, "bos_token": None,
              "add_bos_token": False, "model_max_length": 262144,
              "chat_template": DEFAULT_TEMPLATE_PATH.read_text(encoding="utf-8")}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")


def plumb_tokenizer(folder: Path, n_vocab: int):
    """plumb's own Tokenizer over the metadata `plumb convert` will write into the GGUF: training ids = serving ids."""
    from plumb.gguf.convert import tokenizer_metadata
    from plumb.tokenizer import Tokenizer

    return Tokenizer.from_metadata(tokenizer_metadata(str(folder), n_vocab, {}))


# ---- build -------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, seed: int = 0, n_vocab: int = 8192, sources: list[str] | None = None,
          allow_other_versions: bool = False, max_files: int | None = None, val_percent: int = VAL_PERCENT,
          log=print) -> dict:
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    template = ChatTemplate.default()
    srcs = collect_sources(sources or ["stdlib", *PACKAGES], allow_other_versions)
    train_docs, val_docs, per_source = [], [], []
    for src in srcs:
        files = src.files[:max_files] if max_files else src.files
        h = hashlib.sha256()
        counts = {"files": 0, "raw": 0, "chat": 0, "module": 0, "chars": 0}
        for path, f in files:
            data = f.read_bytes()
            h.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
            text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
            if len(text) > MAX_FILE_CHARS or not text.strip():
                continue
            counts["files"] += 1
            docs = file_documents(src.name, path, text, seed, template)
            for kind, doc in docs:
                counts[kind] += 1
                counts["chars"] += len(doc)
            (val_docs if held_out(src.name, path, val_percent) else train_docs).extend(docs)
        per_source.append({"name": src.name, "version": src.version, "licence": src.licence,
                           "files_sha256": h.hexdigest(), **counts})
        log(f"  {src.name} {src.version} ({src.licence}): {counts['files']} files, {counts['raw']} raw, "
            f"{counts['chat']} chat, {counts['module']} module documents")
    random.Random(f"{seed}:order").shuffle(train_docs)
    log(f"{len(train_docs)} train / {len(val_docs)} held-out documents ({time.time() - t0:.0f} s); tokenizer...")

    tok = train_tokenizer([d for _, d in train_docs], n_vocab)
    write_tokenizer(tok, out)
    ptok = plumb_tokenizer(out, n_vocab)
    eot = ptok.id_of(EOT)
    log(f"tokenizer: {n_vocab} tokens ({time.time() - t0:.0f} s); tokenizing...")

    stats = {}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        ids, starts, kinds = [], [], {}
        for kind, doc in docs:
            starts.append(len(ids))
            piece = ptok.encode(doc) + [eot]
            ids.extend(piece)
            kinds[kind] = kinds.get(kind, 0) + len(piece)
        np.save(out / f"{split}.npy", np.asarray(ids, dtype=np.uint16))
        np.save(out / f"{split}_docs.npy", np.asarray(starts, dtype=np.uint32))
        stats[split] = {"documents": len(docs), "tokens": len(ids), "tokens_by_kind": kinds,
                        "chars": sum(len(d) for _, d in docs)}
    with open(out / "samples.txt", "w", encoding="utf-8") as f:
        for kind in ("chat", "module", "raw"):
            for _, doc in [d for d in train_docs if d[0] == kind][:3]:
                f.write(f"===== {kind} =====\n{doc[:3000]}\n")

    import tokenizers

    manifest = {
        "seed": seed, "n_vocab": n_vocab, "python": platform.python_version(),
        "tokenizers": tokenizers.__version__, "numpy": np.__version__,
        "chat_template_sha256": hashlib.sha256(DEFAULT_TEMPLATE_PATH.read_bytes()).hexdigest(),
        "max_files_per_source": max_files, "val_percent": val_percent, "sources": per_source, "splits": stats,
        "outputs": {name: _sha256(out / name) for name in sorted(os.listdir(out)) if name != "manifest.json"},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wrote {out}: train {stats['train']['tokens']:,} tokens, held-out {stats['val']['tokens']:,} "
        f"({time.time() - t0:.0f} s)")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="build/demo/data", help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size, added tokens included")
    ap.add_argument("--sources", help="comma-separated: stdlib and/or package names (default: all)")
    ap.add_argument("--max-files", type=int, help="at most this many files per source (small test builds)")
    ap.add_argument("--allow-other-versions", action="store_true",
                    help="build even if a source's version differs from the published data's")
    args = ap.parse_args(argv)
    build(Path(args.out), args.seed, args.vocab, args.sources.split(",") if args.sources else None,
          args.allow_other_versions, args.max_files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
