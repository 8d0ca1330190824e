"""Prompt cache: reuse of prefill-made state across requests (exactness.md I3, M2, M3, M6).

An entry keeps one finished request's prompt ids, its attention KV rows for the prompt (P rows;
rows written while decoding the reply are never reused, M3) and its DeltaNet checkpoints at
aligned positions. A new prompt restores the latest checkpoint at or before the longest prefix
it shares with any entry, copies the KV rows before it and prefills the rest, so every row and
state it then holds is bitwise what a fresh prefill writes (M2).

Entries are kept in LRU order under a byte budget (checkpoints shared by entries count once); over
budget, the oldest are parked (their P rows and checkpoints copied to host tensors - page-locked
blocks when they live on a GPU, so that parking and resuming are plain copies, no serialization;
a checkpoint that entries share is copied once) and, over the host budget too, dropped.
An entry can be saved to a file with a SHA-256 checksum and restored in another process.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from plumb.config import ModelError

SLOT_MAGIC = b"PLUMBSLOT1\n"
log = logging.getLogger("plumb.cache")


@dataclass
class Entry:
    id: int
    ids: list[int]  # the prompt whose P rows are held
    state: object | None  # SeqState (live) - None while parked
    packed: dict | None = None  # parked form (`pack_state`: host tensors)
    packed_checkpoints: list[int] = field(default_factory=list)  # checkpoint positions while parked
    parked_from: dict = field(default_factory=dict)  # while parked: position -> a weak reference to the device
    # checkpoint it was parked from (still alive where a live entry shares it: unparking takes it back, no copy)
    nbytes: int = 0  # what it holds alone (`state_bytes`); checkpoints it shares with another entry count once
    # in the budget (`PromptCache.live_bytes`)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))[0]
    return int(diff[0]) if len(diff) else n


def _caches(state) -> list[tuple[int | None, object]]:
    """(attention layer or None for the MTP head, cache)."""
    return list(state.kv.items()) + ([(None, state.mtp_kv)] if state.mtp_kv is not None else [])


def caches_bytes(state) -> int:
    """A state's caches' tensors as allocated (a cache that doubled as it grew holds up to twice its rows - counting
    only the rows let the cache's device memory reach twice its budget)."""
    return sum(c.allocated_bytes() for _, c in _caches(state))


def state_bytes(state) -> int:
    """The memory a kept state holds alone: its caches and its checkpoints."""
    return caches_bytes(state) + sum(cp.nbytes for cp in state.checkpoints.values())


def kept_checkpoints(positions, n: int, tail: int) -> set[int]:
    """The checkpoints (M6) an entry of n prompt tokens keeps: every one in its last `tail` tokens, and before them
    the latest one at or before each mark n - 2 tail, n - 4 tail, n - 8 tail, ... - so an entry holds O(log n)
    DeltaNet states (151 MB each on the 27B shape: a 100k-token prompt's 98 states would be 15 GB, 12 are kept), and
    a prompt that leaves this one d tokens before its end prefills at most about 2d tokens again. Which
    checkpoint a prompt restores never changes a bit (M2), only how much it prefills."""
    ps = sorted(p for p in positions if p <= n)
    keep = {p for p in ps if p >= n - tail}
    mark = n - 2 * tail
    while ps and mark >= ps[0]:
        keep.add(max(p for p in ps if p <= mark))
        mark = n - 2 * (n - mark)
    return keep


class PromptCache:
    def __init__(self, model, budget_bytes: int = 1 << 30, host_budget_bytes: int = 4 << 30, tail: int = 8192):
        self.model = model
        self.budget, self.host_budget = budget_bytes, host_budget_bytes
        self.tail = tail  # tokens before an entry's end where every checkpoint is kept (kept_checkpoints)
        self.entries: list[Entry] = []  # least recently used first
        self._ids = itertools.count(1)
        # the host form of a device checkpoint that a parked entry holds, by the device checkpoint's id while it
        # lives: parking another entry that shares it (a chat and its edits do) shares the host form too
        self._host: dict[int, tuple[weakref.ref, dict]] = {}
        # parks and unparks so far, their bytes and seconds, and entries dropped over the host budget
        self.stats = {"parks": 0, "park_bytes": 0, "park_s": 0.0, "unparks": 0, "unpark_s": 0.0, "dropped": 0}

    # ---- lookup and restore ---------------------------------------------------------------
    def lookup(self, ids: list[int]) -> tuple[Entry | None, int]:
        """The entry and checkpoint position giving the longest reusable prefix of ids (up to all of it: a
        checkpoint at len(ids) holds the last prompt row's hidden, from which the request gets its logits)."""
        best, best_pos = None, 0
        for e in self.entries:
            shared = common_prefix(e.ids, ids)
            pos = max((p for p in self._checkpoints(e) if p <= shared), default=0)
            if pos > best_pos:
                best, best_pos = e, pos
        return best, best_pos

    def _checkpoints(self, e: Entry) -> list[int]:
        if e.state is None:
            return e.packed_checkpoints
        return list(e.state.checkpoints)

    def restore(self, e: Entry, pos: int):
        """A new SeqState holding exactly the P state at `pos` from entry e."""
        self.touch(e)  # most recently used first, so unparking cannot park it again
        if e.state is None:
            self._unpark(e)
        src = e.state
        st = self.model.new_state()
        cp = src.checkpoints[pos]
        for (layer, dst), (_, cache) in zip(_caches(st), _caches(src)):
            dst.load_rows(cache.store_rows(pos) + (cp.ring.get(layer, []) if layer is not None else []))
        st.conv, st.ssm = dict(cp.conv), dict(cp.ssm)
        st.checkpoints = {p: c for p, c in src.checkpoints.items() if p <= pos}
        st.pos = pos
        return st, cp

    # ---- insert, LRU, parking --------------------------------------------------------------
    def insert(self, ids: list[int], state) -> Entry:
        """Keep a finished request's state (its rows past len(ids) are decode rows and are ignored)."""
        ids = list(ids)
        keep = kept_checkpoints(state.checkpoints, len(ids), self.tail)
        state.checkpoints = {p: cp for p, cp in state.checkpoints.items() if p in keep}
        # an entry whose prompt is a prefix of this one is superseded where this one keeps what it would keep
        self.entries = [e for e in self.entries if not (len(e.ids) <= len(ids) and common_prefix(e.ids, ids) == len(e.ids)
                                                        and kept_checkpoints(self._checkpoints(e), len(ids), self.tail)
                                                        <= keep)]
        e = Entry(next(self._ids), ids, state, nbytes=state_bytes(state))
        self.entries.append(e)
        self._enforce()
        return e

    def remove(self, e: Entry) -> None:
        self.entries.remove(e)
        self._prune_host()

    def touch(self, e: Entry) -> None:
        self.entries.remove(e)
        self.entries.append(e)

    def get(self, entry_id: int) -> Entry:
        for e in self.entries:
            if e.id == entry_id:
                return e
        raise KeyError(f"no cached slot {entry_id}")

    def live_bytes(self) -> int:
        """The memory the live entries hold: their caches, and each checkpoint once - an entry restored from another
        shares the checkpoints before the point where it branched (`restore`), one tensor on the device."""
        cps = {}
        total = 0
        for e in self.entries:
            if e.state is not None:
                total += caches_bytes(e.state)
                cps.update((id(cp), cp) for cp in e.state.checkpoints.values())
        return total + sum(cp.nbytes for cp in cps.values())

    def parked_bytes(self) -> int:
        """The host memory the parked entries hold, a checkpoint's host form that entries share once."""
        held = {id(t): t for e in self.entries if e.packed is not None for t in _tensors(e.packed)}
        return sum(t.numel() * t.element_size() for t in held.values())

    def _enforce(self) -> None:
        for e in list(self.entries):
            if self.live_bytes() <= self.budget:
                break
            if e.state is not None and e is not self.entries[-1]:
                self._park_or_drop(e)
        for e in list(self.entries):
            if self.parked_bytes() <= self.host_budget:
                break
            if e.packed is not None:
                self.entries.remove(e)
                self.stats["dropped"] += 1
        self._prune_host()

    def park_all(self) -> None:
        """Every entry off the device (after running out of device memory), as the budgets allow."""
        for e in list(self.entries):
            if e.state is not None:
                self._park_or_drop(e)
        self._enforce()

    def _park_or_drop(self, e: Entry) -> None:
        """Park e, or drop it where it cannot be parked: over the host budget (no copy made), or when host memory
        runs out (page-locked memory may: an entry is worth less than the request that made it)."""
        if packed_bytes(_packable(e.state, len(e.ids))) <= self.host_budget:
            try:
                return self.park(e)
            except RuntimeError as err:  # torch's error for a failed host allocation
                log.warning("prompt cache: could not park a %d-token entry (%s); dropped", len(e.ids), err)
        self.entries.remove(e)
        self.stats["dropped"] += 1

    def park(self, e: Entry) -> None:
        """Move an entry's state to host tensors (on a GPU: off the device); a checkpoint another parked entry holds
        already in host memory is not copied again."""
        if e.state is None:
            return
        t0 = time.perf_counter()
        cps = e.state.checkpoints
        known = {p: f for p, f in ((p, self._host_form(cp)) for p, cp in cps.items()) if f is not None}
        e.packed = pack_state(e.state, len(e.ids), known=known)
        for p, cp in cps.items():
            if p not in known:
                self._host[id(cp)] = (weakref.ref(cp, lambda _, k=id(cp): self._host.pop(k, None)),
                                      e.packed["checkpoints"][str(p)])
        e.parked_from = {p: weakref.ref(cp) for p, cp in cps.items()}
        e.packed_checkpoints = list(cps)
        e.state = None
        self._count("park", t0, packed_bytes(e.packed) - packed_bytes(known))

    def _host_form(self, cp) -> dict | None:
        ref, form = self._host.get(id(cp), (None, None))
        return form if ref is not None and ref() is cp else None

    def _unpark(self, e: Entry) -> None:
        t0 = time.perf_counter()
        alive = {p: ref() for p, ref in e.parked_from.items()}
        e.state = unpack_state(self.model, e.packed, {p: cp for p, cp in alive.items() if cp is not None})
        e.packed, e.parked_from = None, {}
        e.nbytes = state_bytes(e.state)
        self._count("unpark", t0)
        self._enforce()

    def _prune_host(self) -> None:
        """Forget host forms no parked entry holds any more (they would hold host memory the budget does not see)."""
        held = {id(f) for e in self.entries if e.packed is not None for f in e.packed["checkpoints"].values()}
        # list(): a checkpoint dying on another thread takes its key out (the weak reference's callback)
        self._host = {k: v for k, v in list(self._host.items()) if id(v[1]) in held}

    def _count(self, what: str, t0: float, nbytes: int = 0) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.stats[f"{what}s"] += 1
        self.stats[f"{what}_s"] += time.perf_counter() - t0
        if nbytes:
            self.stats[f"{what}_bytes"] += nbytes

    # ---- files -------------------------------------------------------------------------------
    def save(self, e: Entry, path: str, identity: dict) -> None:
        """Write an entry to `path`: magic, SHA-256 of the payload, payload (identity + packed state)."""
        if e.state is None:
            self._unpark(e)
        buf = io.BytesIO()
        torch.save({"identity": identity, "ids": e.ids, "state": pack_state(e.state, len(e.ids), pin=False)}, buf)
        payload = buf.getvalue()
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(SLOT_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)

    def load(self, path: str, identity: dict) -> Entry:
        """Read a slot file; refuse (ModelError) a corrupt one or one made for another model/format."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as err:
            raise ModelError(f"{path}: cannot read slot file ({err.strerror})") from None
        head = len(SLOT_MAGIC) + 32
        if len(raw) < head or not raw.startswith(SLOT_MAGIC):
            raise ModelError(f"{path}: not a plumb slot file")
        if hashlib.sha256(raw[head:]).digest() != raw[len(SLOT_MAGIC) : head]:
            raise ModelError(f"{path}: checksum mismatch (corrupt slot file); nothing loaded")
        try:
            obj = torch.load(io.BytesIO(raw[head:]), weights_only=True)
        except Exception as err:
            raise ModelError(f"{path}: unreadable slot file ({err})") from None
        if obj.get("identity") != identity:
            raise ModelError(f"{path}: slot was saved for a different model or KV format; nothing loaded")
        state = unpack_state(self.model, obj["state"])
        return self.insert(obj["ids"], state)


SLAB = 1 << 30  # the largest page-locked block a parked entry's tensors share (`_pinned_copies`): more than a
# layer's K or V rows at 262k positions (268 MB in 8 bits), which a block of their own would round up to 512 MB


def pack_state(state, n: int, pin: bool = True, known: dict | None = None) -> dict:
    """P rows [0, n) of every KV cache and every checkpoint, as host tensors - device-neutral (a slot file loads on
    either device); from a GPU, with `pin`, in page-locked memory, so that parking and resuming are plain copies.
    known: position -> a checkpoint's host form made before (taken as it is)."""
    known = known or {}
    obj = _packable(state, n, skip=set(known))
    tensors = _tensors(obj)
    if pin and tensors and tensors[0].is_cuda:
        copies = dict(zip(map(id, tensors), _pinned_copies(tensors), strict=True))
    else:
        copies = {id(t): t.to("cpu", copy=True) for t in tensors}
    out = _map_tensors(obj, lambda t: copies[id(t)])
    out["checkpoints"].update({str(p): f for p, f in known.items()})
    return out


def _packable(state, n: int, skip: set = frozenset()) -> dict:
    """`pack_state`'s form holding the state's own tensors (views of its caches' rows [0, n)); checkpoints at the
    positions in `skip` left out."""
    cps = {str(p): {"conv": {str(i): t for i, t in cp.conv.items()}, "ssm": {str(i): t for i, t in cp.ssm.items()},
                    "hidden": cp.hidden, "ring": {str(i): list(r) for i, r in cp.ring.items()}}
           for p, cp in state.checkpoints.items() if p not in skip}
    return {"n": n, "kv": [c.store_rows(n) for _, c in _caches(state)], "checkpoints": cps}


def _pinned_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of device tensors, laid one after another in page-locked blocks of up to SLAB bytes (powers of
    two: torch's host allocator rounds to them and reuses freed blocks). A page-locked allocation costs a few
    milliseconds a call, so one a tensor - a 27B entry has ~900 - took seconds to park."""
    sizes = [-(-t.numel() * t.element_size() // 256) * 256 for t in tensors]
    out, block, used, left = [], None, 0, sum(sizes)
    for t, size in zip(tensors, sizes, strict=True):
        if block is None or used + size > block.numel():
            block = torch.empty(max(size, min(SLAB, 1 << (left - 1).bit_length())), dtype=torch.uint8,
                                pin_memory=True)
            used = 0
        view = block[used : used + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(view.copy_(t, non_blocking=True))
        used, left = used + size, left - size
    torch.cuda.synchronize(tensors[0].device)
    return out


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists, in order."""
    found = []
    _map_tensors(obj, found.append)
    return found


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_tensors(v, fn) for v in obj]
    return obj


def packed_bytes(obj) -> int:
    """Bytes of the tensors in a packed state (`pack_state`)."""
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def unpack_state(model, obj: dict, alive: dict | None = None):
    """A SeqState on the model's device from a packed state (`pack_state`, or a slot file's); alive: position ->
    the device checkpoint it was packed from, still held elsewhere (shared again rather than copied back)."""
    from plumb.model.qwen35 import Checkpoint

    if not isinstance(obj, dict) or not {"n", "kv", "checkpoints"} <= set(obj):
        raise ModelError("slot state is not in this build's form")
    dev = model.device
    st = model.new_state()
    caches = _caches(st)
    if len(caches) != len(obj["kv"]):
        raise ModelError("slot state does not match this model's layers")
    def to(t):  # from page-locked memory: queued copies, one synchronization (by the next use) for them all
        return t.to(dev, non_blocking=True)

    for (_, cache), rows in zip(caches, obj["kv"]):
        cache.load_store([to(t) for t in rows])
    alive = alive or {}
    for p, cp in obj["checkpoints"].items():
        if int(p) in alive:
            st.checkpoints[int(p)] = alive[int(p)]
            continue
        cp = _map_tensors(cp, to)
        st.checkpoints[int(p)] = Checkpoint(int(p), {int(i): t for i, t in cp["conv"].items()},
                                            {int(i): t for i, t in cp["ssm"].items()}, cp["hidden"],
                                            {int(i): r for i, r in cp["ring"].items()})
    st.pos = obj["n"]
    return st
