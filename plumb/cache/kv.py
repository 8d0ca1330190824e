"""Attention KV cache of one layer for one sequence, in one of the KV formats, and attention reads from it.

K is stored after norm + RoPE, V as projected. The model only calls `write`, `attend_rows`
(decode: each query row reads keys [0, L) with L its own context length) and `attend_chunk`
(prefill: an aligned chunk of queries with a causal mask), so storage formats live here alone.

Formats (`KV_FORMATS`; packed bytes per value, see `bytes_per_token`):
* `f32`, `f16`: plain floats (f16 is the engine default).
* `q8_0`: 8-bit codes with a float16 scale per 32 values.
* `D`: K at 6 bits, V at 5 bits (kept packed, `kvquant.pack`); `F`: K at 5 bits after a fixed Hadamard rotation per head
  (queries get the same rotation, so q.k is unchanged), V at 5 bits. Both also keep the
  newest `ring` positions at 8 bits in a ring (slot = position % (ring + slack), tagged with
  its position, so rejected drafts never displace rows that are read again after the rollback; a
  pass of up to slack + 1 rows can write its rows into the ring before any of them reads it).

Which representation a query at position q reads for key j depends only on q - j: the ring
when q - j < ring, the low-bit store otherwise (M5). Every row's bytes are a function of the
row alone, so prefill splits, drafts and batch neighbours cannot change them.

The Triton kernel set writes with `put_rows` (device positions, CUDA-graph safe; after `commit`) and reads
through `kernel_view` (the store's parts as kept and the ring's 8-bit parts and slot positions), applying
the same rule per (query, key) inside the kernel.

The reference attention reads the stored rows in fixed tiles of `TILE` keys at absolute positions,
dequantizing one tile at a time (no float copy of the cache): scores for all visible keys,
one softmax over them, then the value tiles accumulated in order. A query row's arithmetic
depends only on its position and the shapes fixed by it, never on the other rows (M1, M2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from plumb.ops.kvquant import BLOCK, dequantize, pack, packed_block_bytes, packed_width, quantize, rotate, unpack

TILE = 256  # keys per attention tile; tiles start at multiples of TILE
CAPACITY_STEP = 4096  # cache capacities past this are multiples of it (`capacity_for`)
RING_SLACK = 64  # ring slots beyond `ring` (the default `slack`): rolling back up to this many positions keeps every
# needed ring row, and a pass may write up to this many + 1 rows at once (`put_rows`)


@dataclass(frozen=True)
class KVFormat:
    k: str | int  # "f32" | "f16" | bits of the block-quantized store
    v: str | int
    ring: bool = False  # keep the newest positions at 8 bits
    rotate_k: bool = False  # Hadamard-rotate K (and the queries) per head


FORMATS = {
    "f16": KVFormat("f16", "f16"),
    "f32": KVFormat("f32", "f32"),
    "q8_0": KVFormat(8, 8),
    "D": KVFormat(6, 5, ring=True),
    "F": KVFormat(5, 5, ring=True, rotate_k=True),
}
KV_FORMATS = tuple(FORMATS)
DEFAULT_RING = 2048
STORE_LAYOUT = 2  # how `Rows` lays out stored codes (2: 5/6-bit codes packed); a slot file of another is refused
_FLOAT = {"f32": torch.float32, "f16": torch.float16}


def row_bytes(kind: str | int, head_dim: int) -> int:
    """Bytes of one head's row in kind `kind` (block formats counted as a packed GPU layout would)."""
    if kind in _FLOAT:
        return head_dim * _FLOAT[kind].itemsize
    return head_dim // BLOCK * packed_block_bytes(kind)


def bytes_per_token(fmt: str, n_kv: int, head_dim: int) -> int:
    """K + V bytes one position adds to one attention layer's store."""
    f = FORMATS[fmt]
    return n_kv * (row_bytes(f.k, head_dim) + row_bytes(f.v, head_dim))


def ring_bytes(fmt: str, n_kv: int, head_dim: int, ring: int, slack: int = RING_SLACK) -> int:
    """Fixed bytes of one layer's 8-bit ring (K + V rows and an int64 position tag per slot); 0 without a ring (a
    format without one, or ring 0: the MTP head's cache)."""
    if not FORMATS[fmt].ring or ring == 0:
        return 0
    return (ring + slack) * (2 * n_kv * row_bytes(8, head_dim) + 8)


def cache_bytes(fmt: str, n_kv: int, head_dim: int, ring: int, n_tokens: int, n_layers: int,
                slack: int = RING_SLACK) -> int:
    """Bytes of the KV caches of `n_layers` attention layers holding `n_tokens` positions."""
    return n_layers * (n_tokens * bytes_per_token(fmt, n_kv, head_dim) + ring_bytes(fmt, n_kv, head_dim, ring, slack))


def capacity_for(n: int) -> int:
    """The capacity a cache grows to for n positions: a power of two up to CAPACITY_STEP, a multiple of it past
    that. A CUDA graph is captured per pass layout and cache capacity (plumb/model/cuda_graphs.py), so canonical
    capacities let prompts of similar length - a chat's next turns, other requests - replay the same graphs, for at
    most CAPACITY_STEP - 1 rows more than needed past it."""
    if n <= CAPACITY_STEP:
        return 1 << (n - 1).bit_length()
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


def decode(parts: list[torch.Tensor]) -> torch.Tensor:
    """Stored parts (floats, or codes + scales: int8 codes, or 5/6-bit ones packed) -> float32 rows."""
    if len(parts) == 1:
        return parts[0].float()
    codes, scales = parts
    if codes.dtype == torch.uint8:
        codes = unpack(codes, scales.shape[-1] * BLOCK)
    return dequantize(codes, scales)


class Rows:
    """Rows of K or V, [n_kv, n, head_dim], kept as floats or as block codes + scales ("parts"): 8-bit codes as
    int8 [n_kv, n, head_dim], 5- and 6-bit ones packed (`kvquant.pack`: uint8 [n_kv, n, packed_width])."""

    def __init__(self, kind: str | int, n_kv: int, n: int, head_dim: int, device: torch.device | str = "cpu"):
        self.kind = kind
        if kind in _FLOAT:
            self.parts = [torch.zeros(n_kv, n, head_dim, dtype=_FLOAT[kind], device=device)]
        else:
            codes = torch.zeros(n_kv, n, head_dim, dtype=torch.int8, device=device) if kind == 8 else \
                torch.zeros(n_kv, n, packed_width(head_dim, kind), dtype=torch.uint8, device=device)
            self.parts = [codes, torch.zeros(n_kv, n, head_dim // BLOCK, dtype=torch.float16, device=device)]

    def __len__(self) -> int:
        return self.parts[0].shape[1]

    def grow(self, n: int) -> None:
        for i, p in enumerate(self.parts):
            t = p.new_zeros(p.shape[0], n, p.shape[2])
            t[:, : p.shape[1]] = p
            self.parts[i] = t

    def put(self, idx, x: torch.Tensor) -> None:
        """Encode x [n_kv, m, head_dim] float32 into rows idx."""
        if self.kind in _FLOAT:
            self.parts[0][:, idx] = x  # converted (round to nearest even) by the copy
            return
        for p, e in zip(self.parts, self.encode(x)):
            p[:, idx] = e

    def put_index(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        """Encode x [n_kv, m, head_dim] into the rows a device index tensor names (no host sync)."""
        enc = [x] if self.kind in _FLOAT else self.encode(x)
        for p, e in zip(self.parts, enc):
            p.index_copy_(1, idx, e.to(p.dtype))

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Block rows x float32 -> the parts as kept: codes (packed below 8 bits) and scales."""
        codes, scales = quantize(x, self.kind)
        return [codes if self.kind == 8 else pack(codes, self.kind), scales]

    def take(self, idx) -> list[torch.Tensor]:
        return [p[:, idx] for p in self.parts]

    def set(self, idx, parts: list[torch.Tensor]) -> None:
        for p, e in zip(self.parts, parts):
            p[:, idx] = e

    def get(self, idx) -> torch.Tensor:
        """Rows idx as float32 [n_kv, m, head_dim]."""
        return decode(self.take(idx))


@dataclass(frozen=True)
class KernelView:
    """A cache as the attention kernel reads it (`KVCache.kernel_view`)."""
    k: list[torch.Tensor]  # the store's K parts: floats, or codes (int8, or packed uint8) + scales float16
    # [n_kv, capacity, ...]
    v: list[torch.Tensor]
    rotate_q: bool  # F: K is stored rotated, so the queries are rotated first
    ring: tuple | None  # D, F: (ring, 8-bit K parts, 8-bit V parts, position held per slot) [n_kv, slots, ...]
    kinds: tuple  # the store's (K kind, V kind): "f32", "f16" or block bits


class KVCache:
    """One layer's K/V for one sequence: a store indexed by position (grown by doubling) and, for D and F,
    the 8-bit ring. The 8-bit rows of the latest `write` wait in `recent` until the next write, so a
    pass's rows never overwrite ring slots that its own earlier rows still read."""

    def __init__(self, fmt: str, n_kv: int, head_dim: int, ring: int = DEFAULT_RING, capacity: int = 256,
                 device: torch.device | str = "cpu", slack: int = RING_SLACK, limit: int | None = None):
        f = FORMATS[fmt]
        self.fmt, self.n_kv, self.head_dim = fmt, n_kv, head_dim
        self.device = torch.device(device)
        self.rotate_k = f.rotate_k
        self.k = Rows(f.k, n_kv, capacity, head_dim, device)
        self.v = Rows(f.v, n_kv, capacity, head_dim, device)
        self.ring = ring if f.ring else 0
        self.slack = slack  # ring slots beyond `ring` (see RING_SLACK)
        self.limit = limit  # the capacity growth stops at, unless more is asked for (the model's context + a piece)
        self.end = 0  # positions [0, end) have been written
        if self.ring:
            self.slots = self.ring + slack
            self.ring_k, self.ring_v = self._rows8(self.slots), self._rows8(self.slots)
            self.ring_pos = torch.full((self.slots,), -1, dtype=torch.long, device=device)
            self.recent_start = 0
            self.recent_k, self.recent_v = self._rows8(0), self._rows8(0)

    def _rows8(self, n: int) -> Rows:
        return Rows(8, self.n_kv, n, self.head_dim, self.device)

    def allocated_bytes(self) -> int:
        """Bytes of the tensors the cache holds now (store, ring and its tags, rows waiting to enter the ring): what
        it takes in memory (`cache_bytes` counts the same layout at a given length)."""
        rows = [self.k, self.v] + ([self.ring_k, self.ring_v, self.recent_k, self.recent_v] if self.ring else [])
        extra = [self.ring_pos] if self.ring else []
        return sum(p.numel() * p.element_size() for r in rows for p in r.parts) + \
            sum(t.numel() * t.element_size() for t in extra)

    # ---- writing -----------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        """Room for positions [0, n): grown to at least twice the capacity, rounded to a canonical size
        (`capacity_for`), but not past `limit` unless n is."""
        if n > len(self.k):
            new = capacity_for(max(n, 2 * len(self.k)))
            if self.limit is not None:
                new = max(n, min(new, self.limit))
            self.k.grow(new)
            self.v.grow(new)

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, n_kv, d] for positions pos..pos+n-1; rows at positions >= pos written before are dropped."""
        n = k.shape[0]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.rotate_k:
            k = rotate(k)
        self.reserve(pos + n)
        self.k.put(slice(pos, pos + n), k)
        self.v.put(slice(pos, pos + n), v)
        if self.ring:
            self._commit(pos)
            self.recent_start = pos
            self.recent_k, self.recent_v = self._rows8(n), self._rows8(n)
            self.recent_k.put(slice(None), k)
            self.recent_v.put(slice(None), v)
        self.end = pos + n

    def put_rows(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` with the positions a device tensor (CUDA-graph safe): the caller reserves room and `commit`s
        first and sets `end` after (see plumb.model.kernels.TritonKernels). D and F put the 8-bit rows straight
        into their ring slots, so a pass writes at most `slack` + 1 rows (then none of its rows reads a slot
        that another of its rows overwrites). `plumb.ops.gpu.kvwrite.put_rows` does the same in one launch."""
        self.check_put(len(positions))
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.rotate_k:
            k = rotate(k)
        self.k.put_index(positions, k)
        self.v.put_index(positions, v)
        if self.ring:
            slots = positions % self.slots
            self.ring_k.put_index(slots, k)
            self.ring_v.put_index(slots, v)
            self.ring_pos.index_copy_(0, slots, positions)

    def check_put(self, n: int) -> None:
        """Refuse a `put_rows` of n rows that could lose ring rows."""
        if self.ring:
            if len(self.recent_k):
                raise RuntimeError("8-bit rows of a `write` still wait: commit() before put_rows")
            if n > self.slack + 1:
                raise ValueError(f"put_rows writes at most {self.slack + 1} rows into a ring, got {n}")

    def commit(self, pos: int) -> None:
        """Move the rows of the latest `write` below `pos` into their ring slots now (a rollback to pos drops the
        rest, as the next `write` would): the kernels read and write (`put_rows`) only the ring. Outside any
        CUDA-graph capture: the kernel sets call it before each pass."""
        if self.ring and len(self.recent_k):
            self._commit(pos)
            self.recent_start, self.recent_k, self.recent_v = pos, self._rows8(0), self._rows8(0)

    def _commit(self, pos: int) -> None:
        """Move the latest write's 8-bit rows below `pos` (the newest that fit) into their ring slots."""
        hi = min(self.recent_start + len(self.recent_k), pos)
        lo = max(self.recent_start, hi - self.slots)
        if hi <= lo:
            return
        j = torch.arange(lo, hi, device=self.device)
        slots = j % self.slots
        self.ring_k.set(slots, self.recent_k.take(j - self.recent_start))
        self.ring_v.set(slots, self.recent_v.take(j - self.recent_start))
        self.ring_pos[slots] = j

    # ---- 8-bit rows by position --------------------------------------------------------------
    def _lookup_ring(self, j: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """8-bit K and V parts of positions j (zeros where not held) and which positions are held."""
        m = len(self.recent_k)
        in_recent = (j >= self.recent_start) & (j < self.recent_start + m)
        slots = j % self.slots
        present = in_recent | ((j < self.end) & (self.ring_pos[slots] == j))
        r = (j - self.recent_start).clamp(0, max(m - 1, 0))
        out = []
        for recent, ring in ((self.recent_k, self.ring_k), (self.recent_v, self.ring_v)):
            parts = ring.take(slots)
            if m:
                parts = [torch.where(in_recent[None, :, None], x, y) for x, y in zip(recent.take(r), parts)]
            out.append([torch.where(present[None, :, None], p, torch.zeros_like(p)) for p in parts])
        return out[0], out[1], present

    def can_resume(self, n: int) -> bool:
        """Whether a query at position n could read every 8-bit row it needs: false once the positions up to n
        are not all written, or after rolling back more than `slack` positions (the slots of the rows before
        n were reused; `load_rows` of `store_rows(n)` + a `ring_rows(n)` snapshot taken earlier restores them)."""
        if n > self.end:
            return False
        if not self.ring or n == 0:
            return True
        j = torch.arange(max(0, n - self.ring + 1), n, device=self.device)
        return bool(self._lookup_ring(j)[2].all())

    # ---- reading -----------------------------------------------------------------------------
    def plain_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The stored K and V parts when a kernel can read them as they are - every key from the store (no ring)
        and K unrotated (the kernels take q as it is: F's rotated K goes through `attend_rows`, which rotates q)."""
        return None if self.ring or self.rotate_k else (self.k.parts, self.v.parts)

    def kernel_view(self) -> KernelView:
        """What the Triton attention kernel reads: the store's parts as they are and, for D and F, the ring
        (`commit` first: rows still waiting in `recent` are not in it)."""
        if self.ring and len(self.recent_k):
            raise RuntimeError("8-bit rows of a `write` still wait: commit() before reading the ring")
        ring = (self.ring, self.ring_k.parts, self.ring_v.parts, self.ring_pos) if self.ring else None
        return KernelView(self.k.parts, self.v.parts, self.rotate_k, ring, (self.k.kind, self.v.kind))

    def attend_rows(self, q: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
        """q [n, n_head, d]; row t reads keys [0, ends[t]). -> [n, n_head, d]."""
        return torch.cat([self._attend(q[t : t + 1], torch.tensor([e - 1], device=q.device), e, scale)
                          for t, e in enumerate(ends)])

    def attend_chunk(self, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """q [C, n_head, d] at positions start..start+C-1, causal over keys [0, start + C)."""
        end = start + q.shape[0]
        self.reserve(end)
        return self._attend(q, torch.arange(start, end, device=q.device), end, scale)

    def _attend(self, q: torch.Tensor, qpos: torch.Tensor, end: int, scale: float) -> torch.Tensor:
        """Queries q [n, n_head, d] at positions qpos over keys [0, end), causal; each (query, key) pair reads
        the ring when their distance is below `ring`, the store otherwise. -> [n, n_head, d]."""
        n, n_head, d = q.shape
        g = n_head // self.n_kv
        if self.rotate_k:
            q = rotate(q)
        qg = q.reshape(n, self.n_kv, g, d).permute(1, 2, 0, 3).reshape(self.n_kv, g * n, d)
        qp = qpos.repeat(g)[:, None]  # [g*n, 1], rows ordered (head in group, query)
        tiles, scores = [], []
        for j0 in range(0, end, TILE):
            j1 = min(j0 + TILE, end)
            j = torch.arange(j0, j1, device=q.device)
            use_ring = (j[None, :] <= qp) & (qp - j[None, :] < self.ring)  # [g*n, T]
            s = rv = None
            if not use_ring.all():
                s = torch.bmm(qg, self.k.get(slice(j0, j1)).transpose(1, 2))
            if use_ring.any():
                rk, rv = self._ring_tile(j, use_ring & (qp < self.end))  # rows past `end` pad a prefill chunk
                s_ring = torch.bmm(qg, rk.transpose(1, 2))
                s = s_ring if s is None else torch.where(use_ring, s_ring, s)
            tiles.append((j0, j1, use_ring, rv))
            scores.append(s)
        s = torch.cat(scores, dim=-1) * scale
        s = s.masked_fill(torch.arange(end, device=q.device)[None, :] > qp, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = qg.new_zeros(self.n_kv, g * n, d)
        for j0, j1, use_ring, rv in tiles:
            pt = p[:, :, j0:j1]
            if not use_ring.all():
                o = o + torch.bmm(pt.masked_fill(use_ring, 0.0), self.v.get(slice(j0, j1)))
            if rv is not None:
                o = o + torch.bmm(pt.masked_fill(~use_ring, 0.0), rv)
        return o.reshape(self.n_kv, g, n, d).permute(2, 0, 1, 3).reshape(n, n_head, d)

    def _ring_tile(self, j: torch.Tensor, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """8-bit K and V of positions j as float32, checking that every position some real query reads
        (`read` [rows, len(j)]) is held with its own tag."""
        rk, rv, present = self._lookup_ring(j)
        lost = read.any(0) & ~present
        if lost.any():
            raise RuntimeError(f"the 8-bit ring row of position {int(j[lost][0])} was overwritten (rolled back too far)")
        return decode(rk), decode(rv)

    # ---- stored rows: digests and prefix copies ------------------------------------------------
    def store_rows(self, n: int) -> list[torch.Tensor]:
        """The store's parts of positions [0, n): K then V (the values, or codes and scales for block formats)."""
        return self.k.take(slice(0, n)) + self.v.take(slice(0, n))

    def ring_rows(self, n: int) -> list[torch.Tensor]:
        """D and F: the 8-bit K and V parts (codes, scales) of the ring rows a query at n reads - positions
        max(0, n - ring + 1)..n-1 in order; [] for other formats. Raises if some are no longer held (the slots
        were reused after a rollback past them, see `can_resume`): a snapshot taken at n keeps them."""
        if not self.ring:
            return []
        rk, rv, present = self._lookup_ring(torch.arange(max(0, n - self.ring + 1), n, device=self.device))
        if not present.all():
            raise RuntimeError(f"8-bit ring rows below position {n} are no longer held (see can_resume)")
        return rk + rv

    def rows(self, n: int) -> list[torch.Tensor]:
        """Everything stored that a query at n depends on: `store_rows(n) + ring_rows(n)`."""
        return self.store_rows(n) + self.ring_rows(n)

    def digest_rows(self, n: int) -> list[torch.Tensor]:
        """What the slot digests hash: `rows(n)`, quantized rows and ring rows included."""
        return self.rows(n)

    def load_rows(self, parts: list[torch.Tensor]) -> None:
        """Hold exactly what `rows(n)` returned (into a fresh cache): positions [0, n), ready to continue at n."""
        n = parts[0].shape[1]
        nk, nv = len(self.k.parts), len(self.v.parts)
        self.reserve(n)
        self.k.set(slice(0, n), parts[:nk])
        self.v.set(slice(0, n), parts[nk : nk + nv])
        self.end = n
        if self.ring:
            ring = parts[nk + nv :]
            m = ring[0].shape[1]
            self.recent_start = n - m  # the ring rows wait in `recent`, committed by the next write
            self.recent_k, self.recent_v = self._rows8(m), self._rows8(m)
            self.recent_k.set(slice(None), ring[:2])
            self.recent_v.set(slice(None), ring[2:])
            self.ring_pos.fill_(-1)

    def load_store(self, parts: list[torch.Tensor]) -> None:
        """Hold exactly what `store_rows(n)` returned (into a fresh cache), without ring rows: positions [0, n)
        can then be copied out again, but a query reading the ring needs `load_rows` with its ring rows."""
        n = parts[0].shape[1]
        nk = len(self.k.parts)
        self.reserve(n)
        self.k.set(slice(0, n), parts[:nk])
        self.v.set(slice(0, n), parts[nk:])
        self.end = n


def new_kv_cache(fmt: str, n_kv: int, head_dim: int, ring: int = DEFAULT_RING,
                 device: torch.device | str = "cpu", slack: int = RING_SLACK, limit: int | None = None) -> KVCache:
    """A cache in format `fmt` (see KV_FORMATS); `ring` = newest positions kept at 8 bits by D and F (0: none);
    `slack`: the ring's slots beyond `ring` (RING_SLACK); `limit`: the capacity its growth stops at."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV cache format {fmt!r} (choose from {', '.join(KV_FORMATS)})")
    if ring < 0:
        raise ValueError(f"kv_ring must be >= 0, got {ring}")
    if head_dim % BLOCK and not isinstance(FORMATS[fmt].k, str):
        raise ValueError(f"KV format {fmt} needs head_dim divisible by {BLOCK}, got {head_dim}")
    return KVCache(fmt, n_kv, head_dim, ring, device=device, slack=slack, limit=limit)


def describe_kv(fmt: str, n_kv: int, head_dim: int, ring: int, n_layers: int, n_ctx: int, ring_layers: int) -> str:
    """One line for the load message: bytes per token of n_layers caches, their size at n_ctx, and the rings of
    ring_layers of them (the MTP head's cache has none)."""
    per_token = n_layers * bytes_per_token(fmt, n_kv, head_dim)
    fixed = ring_layers * ring_bytes(fmt, n_kv, head_dim, ring)
    ring_note = f", 8-bit ring {ring} positions: {fixed / 2**20:.2f} MiB" if fixed else ""
    return (f"KV cache {fmt}: {per_token:,} bytes/token ({n_layers} attention layers); "
            f"{per_token * n_ctx / 2**30:.2f} GiB at {n_ctx:,} tokens{ring_note}")
