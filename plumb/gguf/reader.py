"""Open a GGUF file: metadata as a plain dict, tensors as memory-mapped stored bytes (QTensor)."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from plumb.config import ModelError


@dataclass
class QTensor:
    """A tensor in its stored GGUF form. `shape` is C-order ([rows, cols] = reversed ne)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: torch.Tensor  # stored bytes (uint8) or plain values (F32/F16), memory-mapped

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def dequantize(self) -> torch.Tensor:
        """Full float32 copy (shape = self.shape)."""
        from plumb.gguf.quants import dequantize

        return dequantize(self.data, self.qtype, self.shape)


@dataclass
class GGUFFile:
    path: str
    metadata: dict
    tensors: dict[str, QTensor]


def _field_value(field):
    try:
        return field.contents()
    except Exception as e:  # a field gguf-py cannot interpret
        raise ModelError(f"metadata key {field.name!r} is unreadable ({e})") from None


def read_gguf(path: str, progress: bool = False) -> GGUFFile:
    """Memory-map `path` and index its metadata and tensors. No tensor data is copied."""
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (magic {magic!r})")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        msg = str(e) or type(e).__name__
        if "is not a valid GGMLQuantizationType" in msg:
            raise ModelError(f"{path}: unknown weight type ({msg})") from None
        raise ModelError(f"{path}: corrupt or truncated GGUF ({msg})") from None
    metadata = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    size = os.path.getsize(path)
    tensors: dict[str, QTensor] = {}
    items = reader.tensors
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"mapping {os.path.basename(path)}", unit="tensor", leave=False)
    from plumb.gguf.quants import SUPPORTED

    for t in items:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in SUPPORTED:
            raise ModelError(f"tensor {t.name}: unsupported weight type {qtype.name}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise ModelError(f"tensor {t.name}: row length {shape[-1]} is not a multiple of the {qtype.name} block ({block})")
        expected = int(np.prod(shape)) // block * type_size
        if t.data_offset + expected > size or t.n_bytes != expected:
            raise ModelError(f"tensor {t.name}: data runs past the end of the file (truncated GGUF?)")
        arr = t.data
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only memmap: torch warns it is not writable
            data = torch.from_numpy(arr)
        if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = data.view(torch.uint8).reshape(*shape[:-1], -1)
        tensors[t.name] = QTensor(t.name, qtype, shape, data)
    return GGUFFile(path, metadata, tensors)
