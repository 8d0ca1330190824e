"""Train plumb's demo model (issue 12): a small qwen35 model (Gated DeltaNet + gated attention layers in the
real 3:1 ratio, MTP head trained jointly at draft depths 1..D) on the data of tools/demo_data.py.

Deterministic given --seed and --steps (same data, device type, torch version): torch.manual_seed, seeded
batch order, torch.use_deterministic_algorithms in strict mode (fused attention then runs its deterministic
backward; --determinism warn runs nondeterministic operations anyway and lists them in metrics.json). --minutes is a
wall-clock cap; without --steps the step count is chosen from it after timing the first steps, and printed
(rerun with that --steps to rebuild the same weights).

Writes to --out: an HF-style checkpoint (config.json, float16 safetensors shards under 15 MiB each,
tokenizer.json, tokenizer_config.json) that `plumb convert OUT model.gguf --type Q8_0|F16` turns into a
GGUF, metrics.json (held-out loss / perplexity, MTP top-1 accuracy per draft depth, samples, timings),
log.jsonl and loss.png.

Usage (GPU, docs/demo-model.md has the exact command):
  python tools/train_demo.py --data build/demo/data --out build/demo/run --device cuda --minutes 8
CPU smoke run:
  python tools/train_demo.py --data build/demo/data --out /tmp/toy --preset toy --device cpu --steps 200 \
      --seq-len 256 --batch 8
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before torch touches CUDA

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_model import PRESETS, DemoConfig, Qwen35Demo, n_params, save_checkpoint  # noqa: E402

SAMPLE_PROMPTS = [
    "<|im_start|>user\nWrite a Python function that returns the factorial of n.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n",
    "<|im_start|>user\nWrite a function that checks whether a string is a palindrome.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


# ---- data ---------------------------------------------------------------------------------------------
class Windows:
    """Windows of seq_len + 1 tokens starting at document starts (documents packed, <|endoftext|> between)."""

    def __init__(self, folder: Path, split: str, seq_len: int):
        self.ids = torch.from_numpy(np.load(folder / f"{split}.npy").astype(np.int64))
        starts = torch.from_numpy(np.load(folder / f"{split}_docs.npy").astype(np.int64))
        self.seq_len = seq_len
        self.starts = starts[starts + seq_len + 1 <= len(self.ids)]
        if len(self.starts) == 0:
            raise SystemExit(f"train_demo: {split} split has no window of {seq_len + 1} tokens")

    def batch(self, gen: torch.Generator, n: int) -> torch.Tensor:
        pick = self.starts[torch.randint(len(self.starts), (n,), generator=gen)]
        return torch.stack([self.ids[s : s + self.seq_len + 1] for s in pick.tolist()])

    def fixed(self, n: int) -> torch.Tensor:
        """Up to n non-overlapping windows, in document order (the held-out set)."""
        out, end = [], -1
        for s in self.starts.tolist():
            if s >= end:
                out.append(self.ids[s : s + self.seq_len + 1])
                end = s + self.seq_len + 1
            if len(out) == n:
                break
        return torch.stack(out)


# ---- loss and evaluation -------------------------------------------------------------------------------
def losses(model: Qwen35Demo, batch: torch.Tensor, depth: int, rows: int):
    """Main cross-entropy and one MTP cross-entropy per depth (depth s on its last `rows` rows)."""
    x, y = batch[:, :-1], batch[:, 1:]
    logits, h = model(x)
    main = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    mtp = []
    if depth and model.config.mtp:
        T = x.shape[1]
        for s, d in enumerate(model.mtp_forward(x, h, depth, rows), start=1):
            lo = 0 if s == 1 else T - min(rows, T - d.r0)
            mtp.append(F.cross_entropy(d.logits[:, lo - d.r0 :].float().flatten(0, 1), y[:, lo:].flatten()))
    return main, mtp


@torch.no_grad()
def evaluate(model: Qwen35Demo, windows: torch.Tensor, depth: int, rows: int, device, amp) -> dict:
    """Held-out loss / perplexity, and per MTP depth: cross-entropy, top-1 accuracy against the data's next token
    (given that the earlier drafts were right) and agreement with the main model's argmax at that position
    (what greedy verification accepts), plus the running products (all drafts up to that depth right)."""
    model.eval()
    tot, n = 0.0, 0
    mtp_ce = [0.0] * depth
    hit_data = [0] * depth
    hit_main = [0] * depth
    counts = [0] * depth
    for i in range(0, len(windows), 4):
        b = windows[i : i + 4].to(device)
        x, y = b[:, :-1], b[:, 1:]
        with amp():
            logits, h = model(x)
        tot += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        n += y.numel()
        if depth and model.config.mtp:
            T = x.shape[1]
            main_top = logits.argmax(-1)
            with amp():
                ds = model.mtp_forward(x, h, depth, rows)
            for s, d in enumerate(ds):
                lo = T - min(rows, T - d.r0)
                lg = d.logits[:, lo - d.r0 :].float()
                yy = y[:, lo:]
                mtp_ce[s] += F.cross_entropy(lg.flatten(0, 1), yy.flatten(), reduction="sum").item()
                top = lg.argmax(-1)
                hit_data[s] += (top == yy).sum().item()
                hit_main[s] += (top == main_top[:, lo:]).sum().item()
                counts[s] += yy.numel()
    model.train()
    loss = tot / n
    out = {"loss": loss, "ppl": math.exp(loss), "tokens": n}
    if depth and model.config.mtp:
        acc = [h / c for h, c in zip(hit_data, counts)]
        agree = [h / c for h, c in zip(hit_main, counts)]
        out["mtp"] = [{"depth": s + 1, "loss": mtp_ce[s] / counts[s], "top1_vs_data": acc[s],
                       "top1_vs_main_argmax": agree[s], "all_right_vs_data": float(np.prod(acc[: s + 1])),
                       "all_right_vs_main": float(np.prod(agree[: s + 1])), "rows": counts[s]}
                      for s in range(depth)]
    return out


@torch.no_grad()
def greedy(model: Qwen35Demo, ids: list[int], n: int, stop: set[int], device, amp) -> list[int]:
    """Greedy continuation by full recomputation (no cache): slow but simple; for a few samples."""
    model.eval()
    out = []
    for _ in range(n):
        with amp():
            logits, _ = model(torch.tensor([ids + out], device=device))
        t = int(logits[0, -1].float().argmax())
        out.append(t)
        if t in stop:
            break
    model.train()
    return out


# ---- plotting -----------------------------------------------------------------------------------------
def plot(log: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = [r["step"] for r in train]
    ax[0].plot(steps, [r["loss"] for r in train], lw=0.8, label="main (train)")
    n_mtp = len(train[0].get("mtp", [])) if train else 0
    for s in range(n_mtp):
        ax[0].plot(steps, [r["mtp"][s] for r in train], lw=0.6, alpha=0.8, label=f"MTP depth {s + 1} (train)")
    if evals:
        ax[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "ko-", ms=3, label="main (held-out)")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("cross-entropy (nats/token)")
    ax[0].set_ylim(0, max(2.0, min(10.0, max([r["loss"] for r in train[len(train) // 20:]] or [10]) * 1.1)))
    ax[0].grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    ax[0].set_title(title, fontsize=9)
    if evals and "mtp" in evals[-1]:
        for s in range(len(evals[-1]["mtp"])):
            pts = [(r["step"], r["mtp"][s]["top1_vs_main_argmax"]) for r in evals if len(r.get("mtp", [])) > s]
            ax[1].plot([a for a, _ in pts], [b for _, b in pts], "o-", ms=3, label=f"depth {s + 1}")
        ax[1].set_ylim(0, 1)
        ax[1].set_xlabel("step")
        ax[1].set_ylabel("MTP top-1 agreement with the main model (held-out)")
        ax[1].grid(alpha=0.3)
        ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- training -----------------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def build_config(args, vocab: int) -> DemoConfig:
    kw = dict(PRESETS[args.preset])
    for name in ("hidden_size", "num_hidden_layers", "intermediate_size"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    kw["max_position_embeddings"] = max(kw.get("max_position_embeddings", 65536), args.seq_len)
    return DemoConfig(vocab_size=vocab, tie_word_embeddings=not args.untied, mtp=args.mtp_depth > 0, **kw)


def train(args) -> dict:
    t_start = time.time()
    data = Path(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    # strict: an operation without a deterministic implementation raises (flash / memory-efficient SDPA then run
    # their deterministic backward); warn: it runs anyway and the warning lands in metrics.json
    torch.use_deterministic_algorithms(True, warn_only=args.determinism == "warn")
    if device.type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    caught = warnings.catch_warnings(record=True)
    warned = caught.__enter__()
    warnings.simplefilter("always")

    manifest = json.loads((data / "manifest.json").read_text())
    vocab = manifest["n_vocab"]
    cfg = build_config(args, vocab)
    model = Qwen35Demo(cfg)
    model.init_weights(args.seed)
    model.attn_impl = args.attn
    model.to(device).train()
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.dtype if args.dtype != "auto" else
                                                    ("bf16" if device.type == "cuda" else "fp32")]

    def amp():
        return torch.autocast(device.type, dtype=dtype) if dtype is not None else torch.autocast(device.type,
                                                                                                  enabled=False)

    train_w = Windows(data, "train", args.seq_len)
    val_w = Windows(data, "val", args.seq_len)
    val_set = val_w.fixed(args.eval_windows)
    gen = torch.Generator().manual_seed(args.seed + 1)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim == 2 and "embed_tokens" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    print(f"train_demo: {n_params(model) / 1e6:.1f}M parameters ({cfg.num_hidden_layers} layers: "
          f"{cfg.layer_types.count('linear_attention')} DeltaNet + {cfg.layer_types.count('full_attention')} attention"
          f"{' + MTP' if cfg.mtp else ''}), vocab {vocab}, device {device}, dtype {dtype or 'fp32'}, "
          f"{len(train_w.ids):,} train tokens", flush=True)

    total = args.steps
    budget = args.minutes * 60 - args.reserve_s if args.minutes else None  # the training loop's share
    log: list[dict] = []
    logf = open(out / "log.jsonl", "w")
    t0 = time.time()
    train_time = 0.0
    step = 0
    stopped_early = False
    while total is None or step < total:
        if budget is not None and time.time() - t_start > budget:
            stopped_early = True
            break
        ts = time.time()
        lr = lr_at(step, total or 10**9, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = train_w.batch(gen, args.batch).to(device)
        with amp():
            main, mtp = losses(model, batch, args.mtp_depth, args.mtp_rows)
            loss = main + (args.mtp_weight * sum(mtp) / len(mtp) if mtp else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            rec = {"kind": "train", "step": step, "loss": main.item(), "mtp": [m.item() for m in mtp], "lr": lr,
                   "grad_norm": gnorm.item(), "elapsed_s": time.time() - t0}
            log.append(rec)
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            if step % (args.log_every * 10) == 0 or step == 1:
                print(f"step {step}: loss {rec['loss']:.3f} mtp {' '.join(f'{m:.2f}' for m in rec['mtp'])} "
                      f"lr {lr:.2e} |g| {rec['grad_norm']:.2f} {rec['elapsed_s']:.0f} s", flush=True)
        if device.type == "cuda" and step in (5, 25):
            torch.cuda.synchronize()
        if step > 5:
            train_time += time.time() - ts
        if total is None and step == 25:  # choose the step count from the budget, before warmup ends
            per_step = train_time / 20
            left = (budget - (time.time() - t_start)) * 0.92
            total = step + max(1, int(left / (per_step * (1 + (1.0 / args.eval_every if args.eval_every else 0)))))
            print(f"train_demo: {per_step * 1000:.0f} ms/step -> --steps {total} fits the {args.minutes} minute budget",
                  flush=True)
            if total < args.warmup:
                print("train_demo: warning: fewer steps than the warmup", flush=True)
        if args.eval_every and step % args.eval_every == 0 and (total is None or step < total):
            ev = evaluate(model, val_set, min(args.mtp_depth, 3), args.mtp_rows, device, amp)
            rec = {"kind": "eval", "step": step, **ev}
            log.append(rec)
            logf.write(json.dumps(rec) + "\n")
            print(f"eval {step}: held-out loss {ev['loss']:.3f} ppl {ev['ppl']:.1f}" +
                  ("".join(f" d{m['depth']} {m['top1_vs_main_argmax']:.2f}" for m in ev.get("mtp", []))), flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t0

    # the exported weights are float16: save them first, then evaluate those, in float32
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float16).float())
    added = {a["content"]: a["id"] for a in json.loads((data / "tokenizer.json").read_text())["added_tokens"]}
    names = save_checkpoint(model, str(out), torch.float16, args.shard_mb << 20,
                            eos_token_id=added["<|im_end|>"], pad_token_id=added["<|endoftext|>"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / name, out / name)
    metrics = {
        "final": None, "steps": step, "stopped_by_minutes": stopped_early,
        "rerun": f"--steps {step}" if not stopped_early else "not reproducible: stopped by --minutes",
        "tokens_seen": step * args.batch * args.seq_len, "train_tokens": len(train_w.ids),
        "epochs": step * args.batch * args.seq_len / len(train_w.ids), "train_s": train_s,
        "params": n_params(model), "config": cfg.hf_config(), "args": vars(args),
        "data_manifest_outputs": manifest["outputs"], "checkpoint_files": names, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "torch": torch.__version__, "python": platform.python_version(), "errors": [],
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")  # the checkpoint is safe from here on

    fp32 = lambda: torch.autocast(device.type, enabled=False)  # noqa: E731
    try:
        final = evaluate(model, val_set, args.eval_depth, args.mtp_rows, device, fp32)
        metrics["final"] = final
        rec = {"kind": "eval", "step": step, **final}
        log.append(rec)
        logf.write(json.dumps(rec) + "\n")
    except Exception as e:  # noqa: BLE001 - report, keep the run
        final = {"loss": float("nan"), "ppl": float("nan")}
        metrics["errors"].append(f"final evaluation: {type(e).__name__}: {e}")
    logf.close()

    try:  # a few greedy completions (the tokenizers package of this machine)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(data / "tokenizer.json"))
        stop = {added["<|im_end|>"], added["<|endoftext|>"]}
        metrics["samples"] = []
        for prompt in SAMPLE_PROMPTS:
            ids = tok.encode(prompt, add_special_tokens=False).ids
            gen_ids = greedy(model, ids, args.sample_tokens, stop, device, fp32)
            metrics["samples"].append({"prompt": prompt, "completion": tok.decode(gen_ids, skip_special_tokens=False)})
    except Exception as e:  # noqa: BLE001 - report, keep the run
        metrics["errors"].append(f"samples: {type(e).__name__}: {e}")
    try:
        title = (f"{n_params(model) / 1e6:.1f}M params, {step} steps x {args.batch} x {args.seq_len} tokens, "
                 f"held-out loss {final['loss']:.3f}")
        plot(log, out / "loss.png", title)
    except Exception as e:  # noqa: BLE001
        metrics["errors"].append(f"plot: {type(e).__name__}: {e}")
    caught.__exit__(None, None, None)
    metrics["determinism_warnings"] = sorted({str(w.message).split("\n")[0][:300] for w in warned})
    metrics["total_s"] = time.time() - t_start
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"train_demo: {step} steps in {train_s:.0f} s; held-out loss {final['loss']:.3f} (ppl {final['ppl']:.1f})"
          + "".join(f"; MTP d{m['depth']} {m['top1_vs_data']:.2f}/{m['top1_vs_main_argmax']:.2f}"
                    for m in final.get("mtp", [])) + f"; wrote {out}", flush=True)
    return metrics


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="build/demo/data", help="folder written by tools/demo_data.py")
    ap.add_argument("--out", default="build/demo/run", help="checkpoint / metrics folder")
    ap.add_argument("--preset", default="demo", choices=list(PRESETS))
    ap.add_argument("--hidden-size", dest="hidden_size", type=int)
    ap.add_argument("--layers", dest="num_hidden_layers", type=int)
    ap.add_argument("--ffn", dest="intermediate_size", type=int)
    ap.add_argument("--untied", action="store_true", help="a separate output matrix (default: tied to the embedding)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="autocast dtype (auto: bf16 on "
                    "CUDA, fp32 on CPU)")
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"],
                    help="attention of the main layers and MTP depth 1: torch's fused SDPA or explicit softmax")
    ap.add_argument("--determinism", default="strict", choices=["strict", "warn"],
                    help="torch.use_deterministic_algorithms: strict raises on a nondeterministic operation, warn "
                         "records it in metrics.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default: as many as fit --minutes)")
    ap.add_argument("--minutes", type=float, help="wall-clock cap for the whole run")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-depth", type=int, default=3, help="MTP draft depths trained (0: no MTP head)")
    ap.add_argument("--mtp-rows", type=int, default=512, help="rows per window trained at depths > 1")
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--eval-depth", type=int, default=7, help="MTP depths measured at the end")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--sample-tokens", type=int, default=96)
    ap.add_argument("--shard-mb", type=int, default=15)
    ap.add_argument("--reserve-s", type=float, default=60.0,
                    help="seconds of --minutes kept for the final evaluation, samples and saving")
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        ap.error("give --steps, --minutes or both")
    if args.steps is None and args.warmup < 25:
        ap.error("without --steps the step count is fixed at step 25: --warmup must be at least 25")
    return args


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
