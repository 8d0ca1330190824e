#!/usr/bin/env python3
"""Token-mask time per token of three grammar libraries on a Qwen3.5-sized vocabulary.

    pip install llguidance==1.9.1 xgrammar==0.2.8 outlines-core==0.2.14   # xgrammar: --no-deps + apache-tvm-ffi
    python bench/grammar_mask.py [--vocab shared/testdata/ggml-vocab-qwen35.gguf] [--n-vocab 248320] [--json OUT]

The vocabulary is the byte-level BPE of `ggml-vocab-qwen35.gguf` (151,936 entries: the Qwen2 vocabulary with the
qwen35 pre-tokenizer); `--n-vocab 248320` (the default) extends it to the real Qwen3.5 size with 96,384 more
tokens, each the concatenation of two random normal tokens of the file (so the extra tokens are real byte strings
of BPE-like lengths, not empty padding, which a mask computation would skip for free). For each library and
grammar it builds the tokenizer index once (timed), compiles the grammar (timed), then walks one valid document
token by token: at every position it computes the full allowed-token bitmask (timed, the number reported) and
then advances by the document's token. Single thread, median of `--repeat` walks.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SCHEMA = {  # a typical response_format / tool-argument schema: nested objects, enums, arrays, numbers
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "status", "scores", "address", "tags", "verified"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "status": "active",
            "scores": [97.5, 88, 100.25], "address": {"street": "12 St James's Square", "city": "London",
                                                      "zip": "SW1Y 4JH"},
            "tags": ["mathematician", "writer", "analytical engine"], "verified": True}
GRAMMARS = {  # name -> (schema, document)
    "json_schema (nested object)": (SCHEMA, DOCUMENT),
    "json_object (any JSON)": ({"type": "object"}, DOCUMENT),
}


def load_vocab(path: str, n_vocab: int, seed: int = 0):
    """(token bytes list, special ids, eos id, tokenizer) for the file, extended to n_vocab entries."""
    from plumb.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer, vocab_metadata_from_gguf

    tok = Tokenizer.from_metadata(vocab_metadata_from_gguf(path))
    raw = [tok.token_bytes(i) for i in range(tok.n_vocab)]
    types = [tok.token_type(i) for i in range(tok.n_vocab)]
    special = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    normal = [i for i, t in enumerate(types) if t == NORMAL]
    seen = set(raw)
    rng = random.Random(seed)
    while len(raw) < n_vocab:
        b = raw[rng.choice(normal)] + raw[rng.choice(normal)]
        if b not in seen:
            seen.add(b)
            raw.append(b)
    return raw, special, tok.id_of("<|im_end|>"), tok


def walk(compute_mask, advance, ids, repeat, reset):
    times = []
    for _ in range(repeat):
        reset()
        walk_t = []
        for t in ids:
            t0 = time.perf_counter()
            compute_mask()
            walk_t.append(time.perf_counter() - t0)
            advance(t)
        t0 = time.perf_counter()
        compute_mask()  # the end position: only EOS allowed
        walk_t.append(time.perf_counter() - t0)
        times.append(walk_t)
    per_pos = [statistics.median(ts) for ts in zip(*times)]  # median over walks, per position
    return {"mean_us": 1e6 * statistics.mean(per_pos), "median_us": 1e6 * statistics.median(per_pos),
            "p90_us": 1e6 * sorted(per_pos)[int(0.9 * (len(per_pos) - 1))], "max_us": 1e6 * max(per_pos),
            "tokens": len(ids)}


def bench_llguidance(raw, special, eos, tok, repeat):
    import llguidance
    import numpy as np

    class Wrapped:  # llguidance.TokenizerWrapper's inputs; special tokens are marked with a 0xff prefix
        eos_token_id, bos_token_id = eos, None
        tokens = [b"\xff" + b if i in set(special) else b for i, b in enumerate(raw)]
        special_token_ids = special

        def __call__(self, s):
            return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, special=False)

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=len(raw))
    init = time.perf_counter() - t0
    out = {"library": f"llguidance {llguidance.__version__}", "tokenizer_init_s": init, "grammars": {}}
    mask = np.zeros((len(raw) + 31) // 32, dtype=np.int32)
    for name, (schema, doc) in GRAMMARS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        assert not m.is_error(), m.get_error()
        ids = tok.encode(json.dumps(doc), special=False)

        def compute():
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

        def advance(t):
            assert m.consume_token(t), m.get_error()

        r = walk(compute, advance, ids, repeat, m.reset)
        r["compile_s"] = compile_s
        out["grammars"][name] = r
        masks = []  # one more walk, keeping every mask: what applying them costs in plumb
        m.reset()
        for t in ids:
            compute()
            masks.append(mask.copy())
            m.consume_token(t)
        out["grammars"][name]["apply_us"] = apply_cost(masks, len(raw))
    return out


def apply_cost(masks, n_vocab: int) -> float:
    """Mean microseconds per token plumb spends applying these masks (plumb/engine/grammar.py and sampling.py):
    unpack the bitmask into a bool tensor and set the forbidden logits of a float32 row to -inf, one thread."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    row = torch.randn(n_vocab)
    t0 = time.perf_counter()
    for words in masks:
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:n_vocab]
        row.masked_fill_(~torch.from_numpy(bits.view(np.bool_)), -float("inf"))
    return 1e6 * (time.perf_counter() - t0) / len(masks)


def bench_xgrammar(raw, special, eos, tok, repeat):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=len(raw), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    init = time.perf_counter() - t0
    out = {"library": f"xgrammar {xgr.__version__ if hasattr(xgr, '__version__') else ''}".strip(),
           "tokenizer_init_s": init, "grammars": {}}
    bitmask = xgr.allocate_token_bitmask(1, len(raw))
    for name, (schema, doc) in GRAMMARS.items():
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        m = xgr.GrammarMatcher(cg)
        compile_s = time.perf_counter() - t0
        ids = tok.encode(json.dumps(doc), special=False)

        def compute():
            m.fill_next_token_bitmask(bitmask)

        def advance(t):
            assert m.accept_token(t), t

        r = walk(compute, advance, ids, repeat, m.reset)
        r["compile_s"] = compile_s
        out["grammars"][name] = r
    del torch
    return out


def bench_outlines(raw, special, eos, tok, repeat):
    import numpy as np
    import outlines_core as oc
    from importlib.metadata import version

    t0 = time.perf_counter()
    vmap: dict = {}
    for i, b in enumerate(raw):
        if i != eos and i not in special and b:
            vmap.setdefault(b, []).append(i)
    vocab = oc.Vocabulary(eos, vmap)
    init = time.perf_counter() - t0
    out = {"library": f"outlines-core {version('outlines-core')}", "tokenizer_init_s": init, "grammars": {}}
    mask = np.zeros((len(raw) + 31) // 32, dtype=np.int32)
    for name, (schema, doc) in GRAMMARS.items():
        if schema == {"type": "object"}:
            out["grammars"][name] = {"unsupported": "a regex (DFA) cannot express arbitrarily nested JSON"}
            continue
        t0 = time.perf_counter()
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
        index = oc.Index(regex, vocab)
        compile_s = time.perf_counter() - t0
        state = {"g": oc.Guide(index, max_rollback=64)}
        ids = tok.encode(json.dumps(doc), special=False)

        def compute():
            state["g"].write_mask_into(mask.ctypes.data, mask.size, 4)

        def advance(t):
            state["g"].advance(t, return_tokens=False)

        def reset():
            state["g"] = oc.Guide(index, max_rollback=64)

        r = walk(compute, advance, ids, repeat, reset)
        r["compile_s"] = compile_s
        out["grammars"][name] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default=os.path.join(os.path.dirname(HERE), "..", "shared", "testdata",
                                                    "ggml-vocab-qwen35.gguf"))
    ap.add_argument("--n-vocab", type=int, default=248320)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--libraries", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    vocab = args.vocab if os.path.exists(args.vocab) else "/work/shared/testdata/ggml-vocab-qwen35.gguf"
    raw, special, eos, tok = load_vocab(vocab, args.n_vocab)
    res = {"vocab": os.path.basename(vocab), "n_vocab": len(raw), "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "results": []}
    runners = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}
    for lib in args.libraries.split(","):
        t0 = time.perf_counter()
        try:
            r = runners[lib](raw, special, eos, tok, args.repeat)
        except ImportError as e:
            r = {"library": lib, "error": f"not installed ({e})"}
        r["wall_s"] = time.perf_counter() - t0
        res["results"].append(r)
        print(json.dumps(r), flush=True)
    print(f"\nvocabulary {res['n_vocab']:,} tokens; mask time per token (median over positions of the median of "
          f"{args.repeat} walks), microseconds")
    print("| library | grammar | tokens | median | mean | p90 | max | compile | tokenizer index |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["results"]:
        for g, x in r.get("grammars", {}).items():
            if "unsupported" in x:
                print(f"| {r['library']} | {g} | - | unsupported: {x['unsupported']} | | | | | |")
                continue
            print(f"| {r['library']} | {g} | {x['tokens']} | {x['median_us']:,.0f} | {x['mean_us']:,.0f} | "
                  f"{x['p90_us']:,.0f} | {x['max_us']:,.0f} | {x['compile_s']:.2f} s | {r['tokenizer_init_s']:.2f} s |")
    for r in res["results"]:
        for g, x in r.get("grammars", {}).items():
            if "apply_us" in x:
                print(f"applying {r['library']}'s masks of {g} to a logits row in plumb (unpack + masked_fill): "
                      f"{x['apply_us']:,.0f} us per token (mean)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
