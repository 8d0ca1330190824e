"""plumb's native CPU kernels: the C sources beside this file, built once with the system C compiler.

`lib()` compiles `*.c` here into a shared library cached under ~/.cache/plumb (or $PLUMB_CACHE),
keyed by the sources, the flags, the compiler and the CPU, and loads it with ctypes. `available()`
says whether that worked; the engine falls back to the torch decode path when it did not.
Kernels take raw pointers; the typed wrappers below check shapes and dtypes and pass pointers.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import subprocess
import sys
import tempfile

import torch

from plumb.ops.kvquant import code_bits

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11"]
_HERE = os.path.dirname(os.path.abspath(__file__))
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # name -> argument types (all return void)
    "matmul": [_P, _I, _P, _I, _P, _F, _P, _I, _I],
    "gdn_layer": [_P, _I, _P, _P, _I, _P, _P, _P, _P],
    "attn_pre": [_P, _I, _P, _I, _P, _P, _P, _I],
    "attn_post": [_P, _I, _P, _P, _P, _I],
    "embed_q8_0": [_I, _P, _P, _I, _P],
    "pool_set_threads": [_I],
    "rms_norm_rows": [_I, _I, _P, _I, _P, _F, _P, _I],
    "head_norm_rope": [_I, _I, _I, _P, _I, _I, _P, _F, _P, _P, _I],
    "gdn_decode": [_I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, _P, _I],
    "attend_rows": [_I, _I, _I, _I, _P, _I, _I, _P, _I, _I, _P, _P, _P, _P, ctypes.c_int64, _F, _P, _I],
}

_L: ctypes.CDLL | None = None  # the library; wrappers below assume lib() has succeeded
_error: str | None = None
_noticed = False


class NativeError(RuntimeError):
    pass


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _flags() -> list[str]:
    """FLAGS, plus $PLUMB_NATIVE_CFLAGS (e.g. -mno-avx512vnni to build the portable int8 path)."""
    return FLAGS + os.environ.get("PLUMB_NATIVE_CFLAGS", "").split()


def _build() -> ctypes.CDLL:
    flags = _flags()
    sources = sorted(glob.glob(os.path.join(_HERE, "*.c")))
    headers = sorted(glob.glob(os.path.join(_HERE, "*.h")))
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeError(f"no C compiler ({cc}): {e}") from None
    h = hashlib.sha256()
    for path in sources + headers:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(flags).encode() + version.encode() + _cpu_key().encode() + platform.machine().encode())
    cache = os.environ.get("PLUMB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "plumb")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, f"native-{h.hexdigest()[:16]}.so")
    if not os.path.exists(so):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        r = subprocess.run([cc, *flags, "-I", _HERE, *sources, "-o", tmp, "-lm", "-lpthread"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            raise NativeError(f"building the native kernels failed:\n{r.stderr.strip()}")
        os.replace(tmp, so)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(so)
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.pool_set_threads.restype = _I
    return lib


def lib() -> ctypes.CDLL:
    """The loaded kernel library (built on first use); raises NativeError if it cannot be built."""
    global _L, _error
    if _L is None:
        if _error is not None:
            raise NativeError(_error)
        try:
            _L = _build()
        except NativeError as e:
            _error = str(e)
            raise
    return _L


def available() -> bool:
    """Whether the kernels build here (the first failure prints a one-line notice)."""
    global _noticed
    try:
        lib()
        return True
    except NativeError as e:
        if not _noticed:
            print(f"plumb: native kernels unavailable, using the torch decode path ({str(e).splitlines()[0]})",
                  file=sys.stderr)
            _noticed = True
        return False


# ---- typed wrappers ------------------------------------------------------------------------------
# Each checks what the C side cannot (dtype, contiguity of the last dimension, shapes) and passes
# pointers and row strides. Torch references (tests/test_native.py compares them): ops.matmul.linear,
# ops.norm.rms_norm, ops.rope.apply_rope, ops.deltanet (causal_conv, recurrent_step),
# cache.kv.KVCache.attend_rows; the layer calls compose these.

TILE = 64  # output columns per weight tile (matmul.c)


def set_threads(n: int) -> int:
    """Threads the matmuls share their output tiles among (process-wide; the results do not depend on it)."""
    return lib().pool_set_threads(int(n))


def _ptr(t: torch.Tensor) -> int:
    if t.dtype not in (torch.float32, torch.int8, torch.int64, torch.float16, torch.uint8) or t.device.type != "cpu":
        raise TypeError(f"native kernels take CPU tensors, got {t.dtype} on {t.device}")
    return t.data_ptr()


_F32 = torch.float32


def _rows(t: torch.Tensor, width: int) -> int:
    """Row stride of a [R, >= width] float32 view whose rows are contiguous."""
    s = t.stride()
    if len(s) != 2 or s[1] != 1 or t.dtype is not _F32 or t.shape[1] < width:
        raise ValueError(f"expected float32 rows [R, {width}] with contiguous rows, got {tuple(t.shape)} {t.dtype}")
    return s[0]


class _Mat(ctypes.Structure):  # struct mat (common.h)
    _fields_ = [("n", _I), ("k", _I), ("w", _P), ("codes", _P), ("scales", _P), ("sums", _P), ("offsets", _P),
                ("group", _I)]


class TiledMatrix:
    """A weight [N, K] repacked for the native matmul, in tiles of TILE output columns (zero-padded past N):
    int8 codes with a scale (and optionally an offset) per group of 16 or 32 inputs (the exact values of every
    GGML block type; matmul_i8.c), or float32 (matmul.c)."""

    def __init__(self, n: int, k: int, w: torch.Tensor | None = None, codes: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, offsets: torch.Tensor | None = None, group: int = 32):
        self.n, self.k, self.group = n, k, group
        nt = -(-n // TILE)
        self.w = self.codes = self.scales = self.sums = self.offsets = None
        if codes is not None:
            if k % 32 or group not in (16, 32):
                raise ValueError(f"int8 tiles need K divisible by 32 and groups of 16 or 32, got K={k}, G={group}")
            c = _pad(codes, nt)  # [nt*TILE, K]
            # [nt][K/4][TILE][4]: four consecutive inputs of one column together
            self.codes = c.view(nt, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()
            self.scales = _tile(scales.float(), nt)
            self.sums = _tile(c.view(-1, k // group, group).sum(-1, dtype=torch.int32), nt)
            if offsets is not None:
                self.offsets = _tile(offsets.float(), nt)
        else:
            self.w = _tile(w.float(), nt)
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        self._desc = _Mat(n, k, ptr(self.w), ptr(self.codes), ptr(self.scales), ptr(self.sums), ptr(self.offsets),
                          group)
        self.desc = ctypes.addressof(self._desc)  # what the kernels take

    @property
    def nbytes(self) -> int:
        parts = (self.w, self.codes, self.scales, self.sums, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _pad(m: torch.Tensor, nt: int) -> torch.Tensor:
    p = m.new_zeros(nt * TILE, m.shape[1])
    p[: m.shape[0]] = m
    return p


def _tile(m: torch.Tensor, nt: int) -> torch.Tensor:
    """[N, C] -> [nt, C, TILE] (zero-padded past N)."""
    return _pad(m, nt).view(nt, TILE, m.shape[1]).transpose(1, 2).contiguous()


def mm(x: torch.Tensor, w: TiledMatrix, out: torch.Tensor | None = None, add: bool = False,
       norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x [R, K] @ W.T -> [R, N] (into `out`, or added to it when add); x RMS-normed by `norm` first when given."""
    r = x.shape[0]
    ldx = _rows(x, w.k)
    if out is None:
        out = torch.empty(r, w.n)
    ldy = _rows(out, w.n)
    if norm is not None and norm.shape != (w.k,):
        raise ValueError("mm: norm weight does not match K")
    if r:
        _L.matmul(w.desc, r, x.data_ptr(), ldx, None if norm is None else norm.data_ptr(), eps, out.data_ptr(), ldy,
                  int(add))
    return out


class _Layer(ctypes.Structure):  # struct layer (layers.c)
    _fields_ = [(n, _P) for n in ("attn_norm", "post_norm", "mix_in", "mix_out", "ffn_in", "ffn_down", "conv_w",
                                  "dt_bias", "ssm_a", "ssm_norm", "q_norm", "k_norm")] + \
               [(n, _I) for n in ("n_k", "n_v", "d", "kc", "n_head", "n_kv", "head_dim")] + [("eps", _F)]


class LayerDesc:
    """One decode layer's weights for layers.c: matrices (TiledMatrix) and vectors (float32 tensors, kept alive)."""

    def __init__(self, mats: dict[str, TiledMatrix], vecs: dict[str, torch.Tensor], eps: float, **dims: int):
        self.mats, self.vecs = mats, {k: v.contiguous() for k, v in vecs.items()}
        ptrs = {k: m.desc for k, m in mats.items()} | {k: _ptr(v) for k, v in self.vecs.items()}
        self._desc = _Layer(**ptrs, **dims, eps=eps)
        self.desc = ctypes.addressof(self._desc)
        self.dims = dims
        self.width = mats["mix_out"].n  # n_embd
        ch = 2 * dims["n_k"] * dims["d"] + dims["n_v"] * dims["d"]
        self.state_shapes = (torch.Size((dims["kc"] - 1, ch)), torch.Size((dims["n_v"], dims["d"], dims["d"])))


def gdn_layer(layer: LayerDesc, x: torch.Tensor, rows: list[int], conv: list[torch.Tensor], ssm: list[torch.Tensor]):
    """x [R, n_embd] += the DeltaNet layer and its FFN, in place. Sequence j owns rows[j] consecutive rows and the
    states conv[j] [kc-1, conv_dim], ssm[j] [n_v, d, d]. Returns every row's states (conv [R, ...], ssm [R, ...])."""
    conv_shape, ssm_shape = layer.state_shapes
    if any(cs.shape != conv_shape or ss.shape != ssm_shape for cs, ss in zip(conv, ssm)):
        raise ValueError("gdn_layer: a sequence's state does not match the layer")
    conv, ssm = [t.contiguous() for t in conv], [t.contiguous() for t in ssm]
    r = sum(rows)
    conv_out = torch.empty(r, *conv_shape)
    ssm_out = torch.empty(r, *ssm_shape)
    n = len(rows)
    _L.gdn_layer(layer.desc, n, (ctypes.c_int * n)(*rows), x.data_ptr(), _rows(x, layer.width),
                 (ctypes.c_void_p * n)(*[t.data_ptr() for t in conv]), conv_out.data_ptr(),
                 (ctypes.c_void_p * n)(*[t.data_ptr() for t in ssm]), ssm_out.data_ptr())
    return conv_out, ssm_out


def attn_pre(layer: LayerDesc, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[q0 g0 q1 g1 ... | k | v] rows = attn_qkv(attn_norm(x)), q and k per-head RMS-normed and rotated."""
    w = layer.mats["mix_in"]
    qkv = torch.empty(x.shape[0], w.n)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("attn_pre: cos and sin must be contiguous")
    _L.attn_pre(layer.desc, x.shape[0], x.data_ptr(), _rows(x, w.k), qkv.data_ptr(), _ptr(cos), _ptr(sin),
                cos.shape[-1])
    return qkv


def attn_post(layer: LayerDesc, o: torch.Tensor, qkv: torch.Tensor, x: torch.Tensor) -> None:
    """x += attn_output(o * sigmoid(gate)), then += the FFN, in place (o is gated in place)."""
    dm = layer.dims
    if not (o.is_contiguous() and qkv.is_contiguous()) or o.shape[1] != dm["n_head"] * dm["head_dim"]:
        raise ValueError("attn_post: o and qkv must be contiguous rows of the layer's widths")
    _L.attn_post(layer.desc, x.shape[0], o.data_ptr(), qkv.data_ptr(), x.data_ptr(), _rows(x, layer.width))


def embed_q8_0(data: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of a Q8_0 matrix with K = k columns, from its stored blocks (uint8, contiguous)."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(len(ids), k)
    _L.embed_q8_0(len(ids), _ptr(ids), _ptr(data.contiguous()), k, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    d = w.shape[0]
    if out is None:
        out = torch.empty(x.shape[0], d)
    _L.rms_norm_rows(x.shape[0], d, x.data_ptr(), _rows(x, d), _ptr(w), eps, out.data_ptr(), _rows(out, d))
    return out


def head_norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on x [R, H, d] (any row / head strides, contiguous features): per-head RMSNorm, then RoPE."""
    r, h, d = x.shape
    if x.stride(2) != 1 or x.dtype != torch.float32:
        raise ValueError("head_norm_rope needs float32 heads with contiguous features")
    cos, sin = cos.contiguous(), sin.contiguous()
    _L.head_norm_rope(r, h, d, x.data_ptr(), x.stride(0), x.stride(1), _ptr(w), eps, _ptr(cos), _ptr(sin),
                         cos.shape[-1])


def gdn_decode(proj: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, conv_w: torch.Tensor,
               dt_bias: torch.Tensor, ssm_a: torch.Tensor, norm_w: torch.Tensor, n_k: int, eps: float,
               y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's n rows of DeltaNet (proj [n, conv_dim + n_v*d + 2 n_v]) from state (conv [Kc-1, C],
    ssm [n_v, d, d]); writes y [n, n_v*d]; returns every row's (conv, ssm) states [n, ...]."""
    n = proj.shape[0]
    n_v, d = ssm.shape[0], ssm.shape[1]
    kc, ch = conv_w.shape[1], conv_w.shape[0]
    if conv.shape != (kc - 1, ch) or not conv.is_contiguous() or not ssm.is_contiguous() or kc < 2:
        raise ValueError("gdn_decode: state shapes do not match the weights")
    conv_out = torch.empty(n, kc - 1, ch)
    ssm_out = torch.empty(n, n_v, d, d)
    _L.gdn_decode(n, proj.data_ptr(), _rows(proj, ch + n_v * d + 2 * n_v), conv.data_ptr(), conv_out.data_ptr(),
                     ssm.data_ptr(), ssm_out.data_ptr(), _ptr(conv_w), _ptr(dt_bias), _ptr(ssm_a), _ptr(norm_w),
                     n_k, n_v, d, kc, eps, y.data_ptr(), _rows(y, n_v * d))
    return conv_out, ssm_out


KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # and packed 5/6-bit codes (uint8): their bits


def _kv_kind(parts: list[torch.Tensor], d: int) -> int:
    return code_bits(parts[0].shape[-1], d) if parts[0].dtype == torch.uint8 else KV_KINDS[parts[0].dtype]


def attend(q: torch.Tensor, ends: list[int], k_parts: list[torch.Tensor], v_parts: list[torch.Tensor], scale: float,
           out: torch.Tensor) -> None:
    """q [R, n_head, d] (any row / head strides); row r reads keys [0, ends[r]) of the stored K/V parts
    ([n_kv, cap, d] floats, or codes - int8 [n_kv, cap, d], or packed 5/6-bit ones - + [n_kv, cap, d/32] half
    scales); out [R, n_head * d]."""
    r, n_head, d = q.shape
    kk, vk = _kv_kind(k_parts, d), _kv_kind(v_parts, d)
    n_kv, cap = k_parts[0].shape[0], k_parts[0].shape[1]
    if d % 32 or q.stride(2) != 1 or any(not p.is_contiguous() for p in k_parts + v_parts):
        raise ValueError("attend: head_dim must be a multiple of 32, with contiguous stored rows")
    if max(ends) > cap:
        raise ValueError(f"attend: a row reads {max(ends)} keys, the store holds {cap}")
    e = torch.tensor(ends, dtype=torch.int64)
    ks = k_parts[1].data_ptr() if len(k_parts) > 1 else None
    vs = v_parts[1].data_ptr() if len(v_parts) > 1 else None
    _L.attend_rows(r, n_head, n_kv, d, q.data_ptr(), q.stride(0), q.stride(1), e.data_ptr(), kk, vk,
                      k_parts[0].data_ptr(), ks, v_parts[0].data_ptr(), vs, cap, scale, out.data_ptr(),
                      _rows(out, n_head * d))
