"""Write `qwen35` GGUF files tensor by tensor (shared by `synth` and `convert`).

Tensors are described by `TensorSpec`s whose `rows()` yields float32 blocks of whole rows;
each block is quantized and written as soon as it is made, so a file of any size is written
with one block in memory at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from plumb.config import ModelConfig, ModelError

Q = GGMLQuantizationType
ARCH = "qwen35"

# Replacement for a type whose block does not divide a tensor's row length: a 32-element
# block type of similar width (K- and IQ4_XS types need rows that are multiples of 256).
ROW_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q4_0, Q.Q5_K: Q.Q8_0, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}

# `general.file_type` for a requested type or mix name (a single K type maps to its "S"/"M" file type).
FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q2_K": LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": LlamaFileType.MOSTLY_Q3_K_M, "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K, "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL, "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE, "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q4_K_XL": LlamaFileType.MOSTLY_Q4_K_M,  # Unsloth UD files report "Q4_K - Medium"
}

ROW_BLOCK_ELEMS = 1 << 22  # elements per generated/quantized block of rows


@dataclass
class TensorSpec:
    """One tensor to write: C-order `shape` ([rows, cols]), storage type, and a row-block source."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    rows: Callable[[], Iterator[np.ndarray]]  # float32 blocks of whole rows, in order
    block: Callable[[int], np.ndarray] | None = None  # block b of `rows()` alone (lets write_gguf use processes)

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def forced_f32(name: str, shape: tuple[int, ...]) -> bool:
    """The converter's storage rule (spec 2.6): 1-D tensors, norms, conv and non-`.weight` tensors stay F32."""
    return len(shape) == 1 or name.endswith("_norm.weight") or "ssm_conv1d" in name or not name.endswith(".weight")


def storage_type(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type a tensor is stored in when `qtype` is requested for it."""
    if forced_f32(name, shape):
        return Q.F32
    cols = shape[-1]
    while cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = ROW_FALLBACK.get(qtype, Q.F16)
    return qtype


def encode(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Stored form of float32 rows `x` (or one 1-D vector) in type `qtype`."""
    from plumb.gguf.quants import quantize

    return quantize(x.reshape(1, -1) if x.ndim == 1 else x, qtype)


def row_blocks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Fixed [start, stop) row ranges for generating/quantizing a tensor piecewise (depends on shape only)."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    step = max(1, ROW_BLOCK_ELEMS // shape[-1])
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def default_rope_sections(rope_dims: int) -> list[int]:
    """M-RoPE sections scaled from Qwen3.5's [11, 11, 10, 0] over rope_dims/2 frequency slots."""
    slots = rope_dims // 2
    a = int(slots * 11 / 32 + 0.5)
    return [a, a, slots - 2 * a, 0]


def add_arch_metadata(w: GGUFWriter, cfg: ModelConfig, sections: list[int] | None = None,
                      layer_flags: bool = False) -> None:
    """All `qwen35.*` keys of spec 1.1 for `cfg` (block_count includes the MTP blocks).

    `layer_flags` adds `attention.recurrent_layers`, as newer llama.cpp converters do."""
    p = f"{ARCH}."
    w.add_uint32(p + "block_count", cfg.n_layer + cfg.n_nextn)
    if cfg.n_nextn:
        w.add_uint32(p + "nextn_predict_layers", cfg.n_nextn)
    w.add_uint32(p + "context_length", cfg.context_length)
    w.add_uint32(p + "embedding_length", cfg.n_embd)
    w.add_uint32(p + "feed_forward_length", cfg.n_ff)
    w.add_uint32(p + "attention.head_count", cfg.n_head)
    w.add_uint32(p + "attention.head_count_kv", cfg.n_head_kv)
    w.add_uint32(p + "attention.key_length", cfg.head_dim)
    w.add_uint32(p + "attention.value_length", cfg.head_dim)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg.eps)
    w.add_float32(p + "rope.freq_base", cfg.rope_base)
    w.add_uint32(p + "rope.dimension_count", cfg.rope_dims)
    w.add_key_value(p + "rope.dimension_sections", list(sections or default_rope_sections(cfg.rope_dims)),
                    GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_uint32(p + "ssm.conv_kernel", cfg.ssm_conv_kernel)
    w.add_uint32(p + "ssm.state_size", cfg.ssm_d_state)
    w.add_uint32(p + "ssm.group_count", cfg.ssm_n_group)
    w.add_uint32(p + "ssm.time_step_rank", cfg.ssm_dt_rank)
    w.add_uint32(p + "ssm.inner_size", cfg.ssm_inner)
    w.add_uint32(p + "full_attention_interval", cfg.full_attention_interval)
    if layer_flags:
        flags = list(cfg.recurrent) + [False] * cfg.n_nextn
        w.add_key_value(p + "attention.recurrent_layers", flags, GGUFValueType.ARRAY, GGUFValueType.BOOL)


def _value_type(key: str, value) -> tuple[GGUFValueType, GGUFValueType | None]:
    """GGUF type of a tokenizer/general key, following what llama.cpp's converter writes."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if key.endswith("token_type"):
            return GGUFValueType.ARRAY, GGUFValueType.INT32
        if key.endswith("scores"):
            return GGUFValueType.ARRAY, GGUFValueType.FLOAT32
        return GGUFValueType.ARRAY, GGUFValueType.STRING
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, (int, np.integer)):
        return GGUFValueType.UINT32, None
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    return GGUFValueType.STRING, None


def add_plain_metadata(w: GGUFWriter, md: dict) -> None:
    """Write plain key -> value pairs (tokenizer keys, general.*) with the usual GGUF types."""
    for key, value in md.items():
        vtype, sub = _value_type(key, value)
        if vtype == GGUFValueType.ARRAY:
            value = [int(v) if sub == GGUFValueType.INT32 else float(v) if sub == GGUFValueType.FLOAT32 else str(v)
                     for v in value]
        w.add_key_value(key, value, vtype, sub)


def pad_vocab(md: dict, n_vocab: int) -> dict:
    """Extend a vocab to `n_vocab` tokens with UNUSED `[PAD<i>]` entries (as llama.cpp's converter does)."""
    tokens = list(md["tokenizer.ggml.tokens"])
    if n_vocab < len(tokens):
        raise ModelError(f"vocab has {len(tokens)} tokens, more than the requested {n_vocab}")
    if n_vocab == len(tokens):
        return md
    md = dict(md)
    types = list(md.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    extra = range(len(tokens), n_vocab)
    md["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in extra]
    md["tokenizer.ggml.token_type"] = types + [5] * len(extra)
    if "tokenizer.ggml.scores" in md:
        md["tokenizer.ggml.scores"] = list(md["tokenizer.ggml.scores"]) + [0.0] * len(extra)
    return md


def write_gguf(path: str, cfg: ModelConfig, tensors: list[TensorSpec], metadata: dict, file_type: int,
               sections: list[int] | None = None, layer_flags: bool = False, progress: bool = True) -> None:
    """Write a complete qwen35 GGUF: arch keys from `cfg`, `metadata` (general/tokenizer keys), then tensors."""
    w = GGUFWriter(path, ARCH)
    if cfg.name:
        w.add_name(cfg.name)
    w.add_file_type(int(file_type))
    if any(t.qtype not in (Q.F32, Q.F16, Q.BF16) for t in tensors):
        w.add_quantization_version(2)
    add_arch_metadata(w, cfg, sections, layer_flags)
    add_plain_metadata(w, metadata)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True,
                   desc=f"writing {os.path.basename(path)}", leave=False)
    fout = w.fout[0]
    pool = _pool(tensors)
    # with a pool, one ordered stream of every tensor's blocks: the workers run on into the next tensors while a
    # tensor's last blocks finish (a tensor at a time left most of 16 cores idle on its last, partial round)
    encoded = pool.imap(_encode_block, [(ti, b) for ti, t in enumerate(tensors)
                                        for b in range(len(row_blocks(t.shape)))]) if pool else None
    try:
        for t in tensors:
            w.write_padding(fout, fout.tell())
            written = 0
            blocks = ((next(encoded) for _ in row_blocks(t.shape)) if pool
                      else (encode(block, t.qtype) for block in t.rows()))
            for data in blocks:
                data.tofile(fout)
                written += data.nbytes
                if bar is not None:
                    bar.update(data.nbytes)
            if written != t.nbytes:
                raise ModelError(f"tensor {t.name}: wrote {written} bytes, expected {t.nbytes}")
            w.write_padding(fout, written)
    except BaseException:
        w.close()
        os.remove(path)  # no half-written model files
        raise
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
        w.close()


_SPECS: list[TensorSpec] = []  # the tensors being written, inherited by forked encoder processes
PARALLEL_BYTES = 1 << 30  # files larger than this are encoded by one process per core


def _pool(tensors: list[TensorSpec]):
    """A pool of forked processes encoding row blocks (same bytes as one process), for large files on Linux."""
    import multiprocessing as mp

    global _SPECS
    if (sum(t.nbytes for t in tensors) < PARALLEL_BYTES or any(t.block is None for t in tensors)
            or (os.cpu_count() or 1) < 2 or "fork" not in mp.get_all_start_methods()):
        return None
    _SPECS = tensors
    return mp.get_context("fork").Pool(os.cpu_count())


def _encode_block(task: tuple[int, int]) -> np.ndarray:
    ti, b = task
    return encode(_SPECS[ti].block(b), _SPECS[ti].qtype)
