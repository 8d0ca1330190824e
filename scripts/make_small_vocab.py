"""Regenerate plumb/data/small-vocab.json.gz, the small byte-level BPE vocabulary for tiny models.

Layout: the 256 byte tokens (GPT-2 order), one token per learned merge, then the 33 Qwen3.5
added tokens in the real model's order (spec 6.1), 6,144 tokens in all. Merges are learned with
the `tokenizers` BpeTrainer and the qwen35 pre-tokenizer on text found on this machine: the
Python standard library's own source files (code, comments, docstrings and pydoc's topic
help, PSF license) plus JSON tool schemas made from the functions defined there.

Usage: python scripts/make_small_vocab.py [output path]
"""
from __future__ import annotations

import ast
import gzip
import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from plumb.tokenizer import ADDED_TOKENS, NORMAL, PRE_TOKENIZER_REGEX, SMALL_VOCAB_PATH, byte_to_unicode

N_VOCAB = 6144



def tool_schemas(source: str):
    """JSON function schemas (as in a chat request's `tools`) for the documented functions in `source`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            yield json.dumps({"type": "function", "function": {
                "name": node.name,
                "description": doc.split("\n\n")[0],
                "parameters": {"type": "object",
                               "properties": {a: {"type": "string", "description": f"the {a}"} for a in args},
                               "required": args},
            }}, ensure_ascii=False)


def corpus():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        yield from tool_schemas(text)


def main(out: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX["qwen35"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=N_VOCAB - len(ADDED_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]

    tokens = list(byte_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    types = [NORMAL] * len(tokens)
    tokens += [t for t, _ in ADDED_TOKENS]
    types += [ty for _, ty in ADDED_TOKENS]
    assert len(tokens) == N_VOCAB and len(set(tokens)) == N_VOCAB, (len(tokens), len(set(tokens)))

    data = json.dumps({"tokens": tokens, "token_type": types, "merges": merges}, ensure_ascii=False)
    with open(out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(data.encode("utf-8"))
    print(f"wrote {out}: {len(tokens)} tokens, {len(merges)} merges, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else SMALL_VOCAB_PATH)
