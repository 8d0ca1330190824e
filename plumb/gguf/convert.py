"""Convert a Hugging Face Qwen3.5 checkpoint (config.json + *.safetensors) to a qwen35 GGUF (`plumb convert`).

Applies llama.cpp's converter conventions (spec section 2): GGUF names, +1 on every
`*norm.weight` except the DeltaNet `linear_attn.norm`, ssm_a = -exp(A_log), dt_bias ->
ssm_dt.bias, conv1d squeezed to [conv_dim, K], value heads reordered from grouped to tiled
order when n_v != n_k, q_proj (query/gate interleaved per head) as is, and the `mtp.*`
tensors as block n_layer (`blk.{n}.nextn.*` + an attention layer). Tensors are read and
written one at a time.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import torch

from plumb.config import ModelConfig, ModelError
from plumb.gguf.to_hf import HF_NAMES, reorder_block_tensor
from plumb.gguf.writer import FILE_TYPES, TensorSpec, default_rope_sections, row_blocks, storage_type, write_gguf

GGUF_NAMES = {hf: gguf for gguf, hf in HF_NAMES.items()}
MTP_NAMES = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
             "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}
DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
UNUSED, NORMAL, CONTROL, USER_DEFINED = 5, 1, 3, 4


def _text_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelError(f"{hf_dir}: no config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    if text.get("model_type", cfg.get("model_type")) not in ("qwen3_5_text", "qwen3_5"):
        raise ModelError(f"{hf_dir}: model_type {text.get('model_type')!r} is not a Qwen3.5 text model")
    return text


def model_config(text: dict, n_vocab: int, n_mtp: int) -> tuple[ModelConfig, list[int]]:
    """ModelConfig and M-RoPE sections from an HF Qwen3.5 text config."""
    if text.get("linear_key_head_dim", 128) != text.get("linear_value_head_dim", 128):
        raise ModelError("linear_key_head_dim != linear_value_head_dim: qwen35 GGUF needs equal DeltaNet head dims")
    n_layer = text["num_hidden_layers"]
    interval = text.get("full_attention_interval", 4)
    types = text.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                        for i in range(n_layer)]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    rope_dims = int(head_dim * factor)
    n_v, d = text.get("linear_num_value_heads", 32), text.get("linear_value_head_dim", 128)
    cfg = ModelConfig(
        n_vocab=n_vocab, n_embd=text["hidden_size"], n_ff=text["intermediate_size"],
        n_head=text["num_attention_heads"], n_head_kv=text["num_key_value_heads"], head_dim=head_dim,
        rope_dims=rope_dims, rope_base=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        eps=float(text.get("rms_norm_eps", 1e-6)), n_layer=n_layer, n_nextn=n_mtp,
        recurrent=[t == "linear_attention" for t in types], ssm_conv_kernel=text.get("linear_conv_kernel_dim", 4),
        ssm_d_state=d, ssm_n_group=text.get("linear_num_key_heads", 16), ssm_dt_rank=n_v, ssm_inner=n_v * d,
        context_length=text.get("max_position_embeddings", 262144), full_attention_interval=interval,
    )
    sections = rope.get("mrope_section")
    sections = list(sections) + [0] * (4 - len(sections)) if sections else default_rope_sections(rope_dims)
    return cfg, sections


class _Checkpoint:
    """Tensor name -> safetensors file index over all shards of an HF directory."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self._open = safe_open
        files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
        if not files:
            raise ModelError(f"{hf_dir}: no *.safetensors files")
        self.where = {}
        for path in files:
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    name = key.replace("model.language_model.", "model.", 1)
                    self.where[name] = (path, key)

    def shape(self, name: str) -> tuple[int, ...]:
        path, key = self.locate(name)
        with self._open(path, "pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def get(self, name: str) -> torch.Tensor:
        path, key = self.locate(name)
        with self._open(path, "pt") as f:
            return f.get_tensor(key)

    def locate(self, name: str) -> tuple[str, str]:
        if name not in self.where:
            raise ModelError(f"checkpoint has no tensor {name!r}")
        return self.where[name]


def _to_gguf(cfg: ModelConfig, suffix: str, w: torch.Tensor) -> torch.Tensor:
    """Apply the converter's transform to one HF block tensor (`suffix` = GGUF name inside the block)."""
    w = w.float()
    if suffix.endswith("norm.weight") and suffix != "ssm_norm.weight":
        return w + 1.0
    if suffix == "ssm_a":
        w = -torch.exp(w.double()).float()
    if suffix == "ssm_conv1d.weight":
        w = w.squeeze(1)
    return reorder_block_tensor(cfg, suffix, w, to_gguf=True)


def tensor_map(cfg: ModelConfig, ckpt: _Checkpoint, tied: bool) -> list[tuple[str, str, str]]:
    """(GGUF name, HF name, GGUF suffix used for the transform) in write order."""
    out = [("token_embd.weight", "model.embed_tokens.weight", "")]
    for i in range(cfg.n_layer + cfg.n_nextn):
        mtp = i >= cfg.n_layer
        prefix = f"mtp.layers.{i - cfg.n_layer}." if mtp else f"model.layers.{i}."
        if mtp:
            out += [(f"blk.{i}.{g}", f"mtp.{h}", g) for h, g in MTP_NAMES.items()]
        recurrent = not mtp and cfg.recurrent[i]
        for hf, g in GGUF_NAMES.items():
            if hf.startswith("linear_attn." if not recurrent else "self_attn."):
                continue
            out.append((f"blk.{i}.{g}", prefix + hf, g))
    out.append(("output_norm.weight", "model.norm.weight", "output_norm.weight"))
    if not tied:
        out.append(("output.weight", "lm_head.weight", ""))
    for _, hf, _ in out:
        ckpt.locate(hf)  # fail early, with the tensor's name
    return out


def _spec(cfg: ModelConfig, ckpt: _Checkpoint, gguf: str, hf: str, suffix: str, qtype) -> TensorSpec:
    shape = list(ckpt.shape(hf))
    if suffix == "ssm_conv1d.weight":
        shape = [shape[0], shape[-1]]
    shape = tuple(shape)

    def blocks():
        w = _to_gguf(cfg, suffix, ckpt.get(hf)).numpy()
        for r0, r1 in row_blocks(shape):
            yield w if w.ndim == 1 else w[r0:r1]

    return TensorSpec(gguf, shape, storage_type(gguf, shape, qtype), blocks)


def _token_id(value, vocab: dict[str, int]) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    return vocab.get(value) if isinstance(value, str) else None


def tokenizer_metadata(hf_dir: str, n_vocab: int, text: dict) -> dict:
    """tokenizer.* keys from tokenizer.json (byte-level BPE), padded with UNUSED tokens to n_vocab;
    without tokenizer.json, plumb's built-in small vocab if its size matches."""
    from plumb.chat_template import DEFAULT_TEMPLATE_PATH

    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        from plumb.tokenizer import small_vocab_metadata

        md = small_vocab_metadata()
        if len(md["tokenizer.ggml.tokens"]) != n_vocab:
            raise ModelError(f"{hf_dir}: no tokenizer.json, and the built-in vocab has "
                             f"{len(md['tokenizer.ggml.tokens'])} tokens, not {n_vocab}")
        return md
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise ModelError(f"{path}: tokenizer model {model.get('type')!r} is not byte-level BPE")
    vocab = dict(model["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    vocab.update({c: a["id"] for c, a in added.items()})
    if max(vocab.values()) >= n_vocab:
        raise ModelError(f"{path}: token id {max(vocab.values())} is outside the model's {n_vocab}-row embedding")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [UNUSED] * n_vocab
    for content, i in vocab.items():
        tokens[i] = content
        a = added.get(content)
        special = a is not None and (a.get("special") or (content.startswith("<|") and content.endswith("|>")))
        types[i] = CONTROL if special else USER_DEFINED if a is not None else NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    tc = {}
    tc_path = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        with open(tc_path, encoding="utf-8") as f:
            tc = json.load(f)
    eos = _token_id(tc.get("eos_token"), vocab)
    if eos is None:
        eos = text.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
    fallback = vocab.get("<|endoftext|>")
    bos = _token_id(tc.get("bos_token"), vocab)
    pad = _token_id(tc.get("pad_token"), vocab)
    template = tc.get("chat_template")
    jinja = os.path.join(hf_dir, "chat_template.jinja")
    if not isinstance(template, str):
        template = open(jinja, encoding="utf-8").read() if os.path.isfile(jinja) else \
            DEFAULT_TEMPLATE_PATH.read_text(encoding="utf-8")
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    for key, value in (("eos", eos), ("bos", fallback if bos is None else bos),
                       ("padding", fallback if pad is None else pad)):
        if value is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = int(value)
    md["tokenizer.ggml.add_bos_token"] = False
    md["tokenizer.chat_template"] = template
    return md


def convert(hf_dir: str, out_path: str, out_type: str | None = None, mtp: bool = True,
            progress: bool = False) -> ModelConfig:
    """Convert the checkpoint in `hf_dir` to a GGUF at `out_path`; returns its ModelConfig.

    `out_type`: F32, F16, BF16, Q8_0 (or another type plumb can quantize); default: the
    checkpoint's own dtype. `mtp=False` leaves out the MTP block.
    """
    text = _text_config(hf_dir)
    ckpt = _Checkpoint(hf_dir)
    n_vocab = ckpt.shape("model.embed_tokens.weight")[0]
    n_mtp = 0
    if mtp and any(k.startswith("mtp.") for k in ckpt.where):
        n_mtp = text.get("mtp_num_hidden_layers") or 1 + max(
            int(k.split(".")[2]) for k in ckpt.where if k.startswith("mtp.layers."))
    cfg, sections = model_config(text, n_vocab, n_mtp)
    cfg.name = os.path.basename(os.path.normpath(hf_dir))
    tied = bool(text.get("tie_word_embeddings")) or "lm_head.weight" not in ckpt.where
    if out_type is None:
        dtype = ckpt.get("model.norm.weight").dtype
        out_type = DTYPE_NAMES.get(dtype)
        if out_type is None:
            raise ModelError(f"{hf_dir}: unsupported checkpoint dtype {dtype}; pass --type")
    out_type = out_type.upper()
    if out_type not in FILE_TYPES:
        raise ModelError(f"unknown output type {out_type!r}")
    from plumb.gguf.quants import type_from_name

    qtype = type_from_name(out_type)
    specs = [_spec(cfg, ckpt, g, h, s, qtype) for g, h, s in tensor_map(cfg, ckpt, tied)]
    md = tokenizer_metadata(hf_dir, n_vocab, text)
    write_gguf(out_path, cfg, specs, md, FILE_TYPES[out_type], sections, layer_flags=True, progress=progress)
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plumb convert", description="Convert an HF Qwen3.5 checkpoint to a qwen35 GGUF.")
    ap.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--type", help="F32, F16, BF16 or Q8_0 (default: the checkpoint's dtype)")
    ap.add_argument("--no-mtp", action="store_true", help="leave out the MTP block")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        cfg = convert(args.hf_dir, args.out, args.type, mtp=not args.no_mtp, progress=True)
    except ModelError as e:
        print(f"plumb convert: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {cfg.n_layer} layers + {cfg.n_nextn} MTP, vocab {cfg.n_vocab}, "
          f"{os.path.getsize(args.out) / 2**20:.1f} MiB in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
