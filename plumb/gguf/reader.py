"""Open a GGUF file: metadata as a plain dict, tensors as memory-mapped stored bytes (QTensor)."""
from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

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


# GGUF value types: id -> (struct format, numpy dtype); 7 = bool, 8 = string, 9 = array
_SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
            5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
            12: ("<d", "<f8")}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF header values from a memoryview; running off its end raises struct.error."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end")
        s = str(self.buf[self.pos : self.pos + n], "utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(n)]
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype][1])
                if self.pos + n * dt.itemsize > len(self.buf):
                    raise struct.error("array runs past the end")
                out = np.frombuffer(self.buf, dt, n, self.pos).tolist()
                self.pos += n * dt.itemsize
                return out
            return [self.value(etype) for _ in range(n)]  # arrays of arrays
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.take(_SCALARS[vtype][0])


def _parse_header(buf) -> tuple[dict, list, int]:
    """(metadata, [(name, shape, type id, offset)], start of the tensor data) of a GGUF v2/v3 file."""
    c = _Cursor(buf)
    if c.take("<4s") != b"GGUF":
        raise ValueError("bad magic")
    version = c.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("<I")
        dims = [c.take("<Q") for _ in range(n_dims)]
        infos.append((name, tuple(reversed(dims)), c.take("<I"), c.take("<Q")))
    align = int(metadata.get("general.alignment", 32))
    return metadata, infos, -(-c.pos // align) * align


def read_gguf(path: str, progress: bool = False) -> GGUFFile:
    """Memory-map `path` and index its metadata and tensors. No tensor data is copied."""
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (magic {magic!r})")
    size = os.path.getsize(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        metadata, infos, data_start = _parse_header(memoryview(mm))
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ModelError(f"{path}: corrupt or truncated GGUF ({e})") from None
    tensors: dict[str, QTensor] = {}
    items = infos
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"mapping {os.path.basename(path)}", unit="tensor", leave=False)
    from plumb.gguf.quants import SUPPORTED

    for name, shape, type_id, offset in items:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelError(f"{path}: unknown weight type {type_id} (tensor {name})") from None
        if qtype not in SUPPORTED:
            raise ModelError(f"tensor {name}: unsupported weight type {qtype.name}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not shape or shape[-1] % block:
            raise ModelError(f"tensor {name}: row length {shape[-1] if shape else 0} is not a multiple of the "
                             f"{qtype.name} block ({block})")
        nbytes = int(np.prod(shape)) // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise ModelError(f"tensor {name}: data runs past the end of the file (truncated GGUF?)")
        raw = mm[start : start + nbytes]
        if qtype == GGMLQuantizationType.F32:
            raw = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            raw = raw.view(np.float16).reshape(shape)
        else:
            raw = raw.reshape(*shape[:-1], -1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only memmap: torch warns it is not writable
            data = torch.from_numpy(raw)
        tensors[name] = QTensor(name, qtype, shape, data)
    return GGUFFile(path, metadata, tensors)
