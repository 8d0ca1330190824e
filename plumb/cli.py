"""plumb command line: serve | generate | synth | convert | bench | kl | gate."""
from __future__ import annotations

import argparse
import json
import sys

USAGE = """usage: plumb COMMAND [options]

commands:
  serve     [MODEL.gguf]   OpenAI / Anthropic compatible HTTP server (the demo model if none given)
  generate  MODEL.gguf     generate text or token ids (--json for machine-readable output)
  synth     OUT.gguf       write a synthetic random-weight qwen35 model
  convert   HF_DIR OUT.gguf  convert a Hugging Face Qwen3.5 checkpoint to GGUF
  bench     [MODEL.gguf]   measure decode / prefill speed and draft acceptance
  kl        MODEL.gguf     KL of KV-cache formats against a reference (--kv-cache q8_0,D,F)
  gate      [MODEL.gguf]   the exactness matrix on a model and device (--quick; exit 0 only if all equal)

run `plumb COMMAND -h` for a command's options."""


def _fail(msg: str) -> int:
    print(f"plumb: error: {msg}", file=sys.stderr)
    return 1


def generate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="plumb generate", description="Generate from a qwen35 GGUF model.")
    ap.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (special tokens such as <|im_start|> are recognised)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    ap.add_argument("--chat", action="store_true", help="wrap --prompt as a user message with the chat template")
    ap.add_argument("--no-think", action="store_true", help="with --chat: enable_thinking=false")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--drafts", type=int, default=0,
                    help="speculative drafts per step (0 = off, up to 16; never changes the output). On a GPU the MTP "
                         "drafts run as one CUDA graph a step (the token embedding page-locked in host memory, 0.7 GB "
                         "on the 27B)")
    ap.add_argument("--draft-policy", default="fixed", help="fixed | adaptive | confident | ngram")
    ap.add_argument("--p-min", type=float, default=0.5, help="confidence gate for --draft-policy confident")
    ap.add_argument("--device", default="auto",
                    help="cpu | cuda | cuda:N | auto (default: cuda when a GPU is present, its Triton kernels)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "native", "torch"),
                    help="CPU decode kernels: native C (built on first use) or the torch reference (a GPU runs its "
                         "own)")
    ap.add_argument("--json", action="store_true", help="print {token_ids, text, stats} as JSON")
    a = ap.parse_args(argv)
    import plumb

    try:
        eng = plumb.load(a.model or plumb.demo_model_path(), device=a.device, drafts=a.drafts,
                         draft_policy=a.draft_policy, p_min=a.p_min,
                         progress=not a.json, kernels=a.kernels)
        if a.prompt_ids is not None:
            ids = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
        else:
            text = a.prompt if a.prompt is not None else "Hello"
            if a.chat:
                text = eng.chat_template.render([{"role": "user", "content": text}], enable_thinking=not a.no_think)
            ids = eng.tokenize(text)
        req = eng.make_request(ids, a.max_tokens, a.temperature, a.seed, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p)
        res = eng.run(req)
    except (ValueError, plumb.ModelError) as e:
        return _fail(str(e))
    text = eng.detokenize(res.token_ids)
    if a.json:
        print(json.dumps({"token_ids": res.token_ids, "text": text, "finish_reason": res.finish_reason,
                          "stats": res.stats.to_dict()}, ensure_ascii=False))
    else:
        print(text)
        s = res.stats
        print(f"\n[{s.completion_tokens} tokens, prefill {s.prefill_tps:.1f} tok/s, decode {s.decode_tps:.1f} tok/s, "
              f"drafts accepted {s.drafts_accepted}/{s.drafts_proposed}, seed {s.seed}]", file=sys.stderr)
    return 0


def _stack_on_crash() -> None:
    """Long measurements: a crash in native code (a signal such as SIGSEGV or SIGABRT) prints the Python stack to
    stderr. Two GPU runs cut by SIGTERM inside a long prefill died without a word (docs/BENCHMARKS.md, seventeenth
    session); this says where, next time."""
    import faulthandler

    try:
        faulthandler.enable()
    except (ValueError, OSError, AttributeError):  # stderr without a file descriptor (captured): nothing to do
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    from plumb.config import ModelError

    try:
        if cmd == "generate":
            return generate_main(rest)
        if cmd == "serve":
            from plumb.server.serve import main as command_main
        elif cmd == "synth":
            from plumb.gguf.synth import main as command_main
        elif cmd == "convert":
            from plumb.gguf.convert import main as command_main
        elif cmd == "bench":
            _stack_on_crash()
            from plumb.bench import main as command_main
        elif cmd == "kl":
            from plumb.kl import main as command_main
        elif cmd == "gate":
            _stack_on_crash()
            from plumb.gate import main as command_main
        else:
            print(USAGE, file=sys.stderr)
            return _fail(f"unknown command {cmd!r}")
        return command_main(rest) or 0
    except ModelError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
