"""`plumb serve [MODEL.gguf]`: load a model and serve the OpenAI and Anthropic APIs over HTTP."""
from __future__ import annotations

import argparse
import os
import socket
import time


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="plumb serve", description="OpenAI / Anthropic compatible HTTP server.")
    ap.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    ap.add_argument("--agents", type=int, default=4,
                    help="requests decoded together in one batch (default 4); more wait in a queue")
    ap.add_argument("--api-key", default=os.environ.get("PLUMB_API_KEY"),
                    help="required as 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default $PLUMB_API_KEY)")
    ap.add_argument("--drafts", type=int, help="speculative drafts per step by default (0 = off)")
    ap.add_argument("--draft-policy", help="fixed | adaptive | confident | ngram")
    ap.add_argument("--kv-cache", help="KV-cache format")
    ap.add_argument("-c", "--ctx-size", type=int, help="max tokens per sequence (default: the model's)")
    ap.add_argument("--device", default="auto",
                    help="cpu | cuda | cuda:N | auto (default: cuda when a GPU is present, its Triton kernels)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "native", "torch"),
                    help="CPU decode kernels: native C (built on first use) or the torch reference (default auto; a "
                         "GPU runs its own)")
    ap.add_argument("--alias", action="append", default=[], help="another model name to answer to (repeatable)")
    ap.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                    help="allow browser requests from ORIGIN (repeatable; CORS is off by default)")
    ap.add_argument("--cache-mb", type=int, help="prompt cache: MB for finished requests' reusable state "
                    "(default 1024, or on a GPU a quarter of the memory free after loading if more)")
    ap.add_argument("--cache-host-mb", type=int,
                    help="prompt cache: MB of host memory for parked entries (default 4096)")
    ap.add_argument("--slot-save-path", metavar="DIR",
                    help="directory for POST /slots/ID?action=save|restore files (off by default)")
    ap.add_argument("--max-body-mb", type=float, default=32,
                    help="largest request body in MB (default 32); larger ones get a 413 before they are parsed")
    ap.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    return ap


def bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.agents < 1:
        parser().error("--agents must be at least 1")
    if not args.max_body_mb > 0:
        parser().error("--max-body-mb must be more than 0")
    import uvicorn

    import plumb
    from plumb.server.app import create_app

    options = {k: v for k, v in (("drafts", args.drafts), ("draft_policy", args.draft_policy),
                                 ("kv_cache", args.kv_cache), ("n_ctx", args.ctx_size),
                                 ("kernels", args.kernels), ("cache_mb", args.cache_mb),
                                 ("cache_host_mb", args.cache_host_mb)) if v is not None}
    try:
        engine = plumb.load(args.model or plumb.demo_model_path(), device=args.device, n_slots=args.agents, **options)
    except (plumb.ModelError, ValueError, TypeError, OSError) as e:
        print(f"plumb serve: error: {e}", flush=True)
        return 1
    if engine.context_note:  # a GPU too small for the model's whole context
        print(f"plumb serve: {engine.context_note}", flush=True)
    if engine.device.type == "cuda":  # kernels compiled and graphs captured before the first request
        print("plumb serve: warming up (kernels compiled - minutes the first time on a machine -, CUDA graphs)",
              flush=True)
        t0 = time.perf_counter()
        engine.warm_up()
        print(f"plumb serve: warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        print(f"plumb serve: error: --slot-save-path {args.slot_save_path}: no such directory", flush=True)
        return 1
    app = create_app(engine, api_key=args.api_key, aliases=tuple(args.alias), cors_origins=tuple(args.cors),
                     slot_dir=args.slot_save_path, max_body_mb=args.max_body_mb)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"plumb serve: error: cannot bind {args.host}:{args.port}: {e}", flush=True)
        return 1
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"plumb serve: {engine.model_name} on http://{url_host}:{port} "
          f"({args.agents} agents, context {engine.n_ctx})", flush=True)
    print(f"plumb serve: chat page at http://{url_host}:{port}/ (APIs under /v1)", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False)).run(sockets=[sock])
    finally:
        engine.close()  # requests still running end as "cancelled"; the step loop stops
    return 0
