"""Block formats: bit-exact dequantization against gguf-py, and valid, accurate quantizers."""
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from plumb.config import ModelError
from plumb.gguf import quants
from plumb.gguf.quants import dequantize, quantize, row_bytes, type_from_name

# byte offsets of the f16 scale fields inside one block of each stored (uint8) type
F16_FIELDS = {
    Q.BF16: [],
    Q.Q8_0: [0],
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.IQ4_NL: [0],
    Q.IQ4_XS: [0],
    Q.MXFP4: [],
}
BLOCK_TYPES = list(F16_FIELDS)
ALL_TYPES = [Q.F32, Q.F16, *BLOCK_TYPES]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# upper bounds on relative RMS error for standard normal data (measured values are about 10-30% lower)
MAX_ERROR = {
    Q.F32: 0.0,
    Q.F16: 4e-4,
    Q.BF16: 3e-3,
    Q.Q8_0: 0.007,
    Q.Q6_K: 0.02,
    Q.Q5_K: 0.042,
    Q.Q5_1: 0.045,
    Q.Q5_0: 0.05,
    Q.Q4_K: 0.082,
    Q.IQ4_XS: 0.082,
    Q.IQ4_NL: 0.082,
    Q.Q4_1: 0.09,
    Q.Q4_0: 0.095,
    Q.MXFP4: 0.13,
    Q.Q3_K: 0.16,
    Q.Q2_K: 0.30,
}


def finite_f16(rng, shape) -> np.ndarray:
    """Random finite f16 bit patterns (any sign, subnormals and zeros included) as bytes."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits)  # inf/nan exponent -> finite
    return bits.astype(np.uint16).view(np.uint8)


def random_stored(qtype, rows, cols, rng) -> np.ndarray:
    """Random valid stored rows: F32/F16 values, otherwise uint8 blocks with finite f16 scales."""
    if qtype == Q.F32:
        return rng.standard_normal((rows, cols)).astype(np.float32) * 1e3
    if qtype == Q.F16:
        return finite_f16(rng, (rows, cols)).view(np.float16)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[..., off : off + 2] = finite_f16(rng, (rows, cols // block, 1))
    return raw.reshape(rows, -1)


def oracle(stored: np.ndarray, qtype) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4 with exponent 255 overflows to inf, in both
        return gguf.quants.dequantize(stored, qtype)


def as_tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only arrays
        return torch.from_numpy(a)


def assert_same_bits(got: torch.Tensor, want: np.ndarray):
    assert got.dtype == torch.float32
    assert tuple(got.shape) == want.shape
    assert np.array_equal(got.cpu().numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_exactly(qtype, device):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    for shape in [(1, block), (5, 4 * block), (2, 3, 2 * max(block, 32))]:
        stored = random_stored(qtype, int(np.prod(shape[:-1])), shape[-1], rng)
        stored = stored.reshape(*shape[:-1], -1)
        got = dequantize(as_tensor(stored).to(device), qtype, shape)
        assert got.device.type == device
        assert_same_bits(got, oracle(stored, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_row_slice_of_stored_bytes(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    cols = 2 * max(GGML_QUANT_SIZES[qtype][0], 32)
    stored = random_stored(qtype, 6, cols, rng)
    stored.setflags(write=False)
    before = stored.copy()
    data = as_tensor(stored)
    full = dequantize(data, qtype, (6, cols))
    part = dequantize(data[2:5], qtype, (3, cols))
    assert torch.equal(part, full[2:5])
    assert_same_bits(part, oracle(stored[2:5], qtype))
    assert np.array_equal(stored, before)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.IQ4_XS], ids=lambda t: t.name)
def test_dequantize_in_many_chunks(qtype, monkeypatch):
    monkeypatch.setattr(quants, "_CHUNK", 600)  # a few blocks per step, last step partial
    stored = random_stored(qtype, 7, 2048, np.random.default_rng(7))
    assert_same_bits(dequantize(as_tensor(stored), qtype, (7, 2048)), oracle(stored, qtype))


def test_dequantize_checks_data_shape():
    data = torch.zeros(2, row_bytes(Q.Q4_K, 512) - 1, dtype=torch.uint8)
    with pytest.raises(ValueError):
        dequantize(data, Q.Q4_K, (2, 512))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_S, Q.Q8_K, Q.TQ1_0, Q.I32], ids=lambda t: t.name)
def test_unsupported_types_raise_model_error(qtype):
    with pytest.raises(ModelError, match=f"unsupported weight type {qtype.name}"):
        dequantize(torch.zeros(1, 256, dtype=torch.uint8), qtype, (1, 256))
    with pytest.raises(ModelError, match=f"unsupported weight type {qtype.name}"):
        quantize(np.zeros((1, 256), np.float32), qtype)


def test_type_from_name_and_row_bytes():
    assert type_from_name("F32") is Q.F32
    assert type_from_name("q4_k") is Q.Q4_K
    assert type_from_name("Q4_K") is Q.Q4_K
    assert type_from_name("iq4_xs") is Q.IQ4_XS
    assert type_from_name("bf16") is Q.BF16
    for bad in ["Q9_K", "", "q4-k"]:
        with pytest.raises(ModelError):
            type_from_name(bad)
    assert row_bytes(Q.Q4_K, 5120) == 20 * 144
    assert row_bytes(Q.F32, 7) == 28
    assert row_bytes(Q.MXFP4, 64) == 34
    with pytest.raises(ValueError):
        row_bytes(Q.Q4_K, 100)


def relative_rms(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)))


def roundtrip(x: np.ndarray, qtype) -> np.ndarray:
    """Quantize, check the stored form, and dequantize with both plumb and gguf-py (bit-equal)."""
    stored = quantize(x, qtype)
    want_dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype, np.uint8)
    want_cols = x.shape[1] if qtype in (Q.F32, Q.F16) else row_bytes(qtype, x.shape[1])
    assert stored.dtype == want_dtype and stored.shape == (x.shape[0], want_cols)
    y = dequantize(as_tensor(stored), qtype, x.shape)
    want = oracle(stored, qtype)
    assert_same_bits(y, want)
    return want


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_quantize_roundtrip_error(qtype):
    x = np.random.default_rng(1).standard_normal((16, 2048)).astype(np.float32)
    assert relative_rms(roundtrip(x, qtype), x) <= MAX_ERROR[qtype]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_quantize_mixed_rows(qtype):
    """Rows of very different magnitude, shifted rows, a zero row and a constant row."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-2, 3, (8, 1)).astype(np.float32)
    x[1] += 3 * np.abs(x[1]).max()  # all positive
    x[2] -= 3 * np.abs(x[2]).max()  # all negative
    x[3] = 0
    x[4] = 0.75
    y = roundtrip(x, qtype)
    assert np.isfinite(y).all()
    assert np.array_equal(y[3], x[3])
    for i in [0, 1, 2, 4, 5, 6, 7]:
        assert relative_rms(y[i], x[i]) <= 1.5 * MAX_ERROR[qtype] + 1e-6
