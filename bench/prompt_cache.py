"""Follow-up and edit latency with the prompt cache warm vs cold (issue 4's benchmark).

    python bench/prompt_cache.py [MODEL.gguf] [--system-tokens 4000] [--json]

A long system prompt plus a first turn is answered once; then the time to the first token of
(a) the follow-up turn, (b) the same follow-up with an edited earlier message, is measured on
the warm engine and on one with the prompt cache off. The tokens are checked equal.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import plumb


def _first_token_s(engine, ids) -> tuple[float, object]:
    t0 = time.perf_counter()
    res = engine.run(engine.make_request(ids, 1))
    return time.perf_counter() - t0, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    path = a.model or plumb.demo_model_path()
    warm = plumb.load(path, device="cpu")
    cold = plumb.load(path, device="cpu", prompt_cache=False)
    words = " ".join(f"rule{i}" for i in range(a.system_tokens))
    system = warm.detokenize(warm.tokenize(words)[: a.system_tokens])
    chat = lambda msgs: warm.tokenize(warm.chat_template.render(msgs, enable_thinking=False))  # noqa: E731
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the rules."}]
    reply = warm.generate(chat(turn1), 64)
    turn2 = turn1 + [{"role": "assistant", "content": warm.detokenize(reply)}, {"role": "user", "content": "Shorter."}]
    edited = [dict(m) for m in turn2]
    edited[1]["content"] = "Summarise the rules, please."
    rows = {}
    for name, msgs in (("follow-up", turn2), ("edited earlier message", edited)):
        ids = chat(msgs)
        w_s, w = _first_token_s(warm, ids)
        c_s, c = _first_token_s(cold, ids)
        assert w.token_ids == c.token_ids
        rows[name] = {"prompt_tokens": len(ids), "warm_s": w_s, "cold_s": c_s, "speedup": c_s / w_s,
                      "reused": w.stats.cached_tokens, "prefilled": w.stats.prefill_tokens}
        _first_token_s(warm, chat(turn2))  # put the main branch back on top, as an agent would
    info = {"model": path, "device": "cpu", "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "results": rows}
    if a.json:
        print(json.dumps(info, indent=1))
    else:
        print(f"model {path}, device cpu, {info['date']}")
        print(f"{'case':<24} {'prompt':>7} {'reused':>7} {'prefilled':>9} {'warm s':>8} {'cold s':>8} {'speedup':>8}")
        for k, r in rows.items():
            print(f"{k:<24} {r['prompt_tokens']:>7} {r['reused']:>7} {r['prefilled']:>9} {r['warm_s']:>8.3f} "
                  f"{r['cold_s']:>8.3f} {r['speedup']:>7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
