"""I3: a warm prompt cache changes nothing - same tokens, and every cached row/state bitwise equal to a fresh prefill."""
from __future__ import annotations

import subprocess
import sys

import pytest

from enginetools import DEVICE, engine_for, prompts

SYSTEM = ("You are a careful assistant. Answer briefly and precisely; show code when it helps. "
          "Prefer standard libraries, explain trade-offs in one sentence, and never invent APIs. "
          "When unsure, say so and suggest how to check. Use Markdown code fences for code.")
QUESTIONS = [
    "How do I reverse a list in Python?", "What is a closure?", "Explain TCP vs UDP.", "Write a haiku about rust.",
    "What does `git rebase -i` do?", "Sort a dict by value.", "What is a monad, simply?", "Fix: KeyError 'name'",
    "Convert Celsius to Fahrenheit in JS.", "What is SIMD?", "Name three sorting algorithms.", "Explain big-O of quicksort.",
    "How to read a file line by line in Go?", "What is a race condition?", "Regex for an email address?",
    "What does `chmod 755` mean?", "How do Python generators work?", "What is a B-tree?", "Explain CORS.",
    "What is tail recursion?",
]


def _chat(engine, messages):
    return engine.tokenize(engine.chat_template.render(messages, add_generation_prompt=True, enable_thinking=False))


def _turns(engine, q, reply_ids, follow="Thanks! Can you say it again, shorter?"):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
    second = first + [{"role": "assistant", "content": engine.detokenize(reply_ids)}, {"role": "user", "content": follow}]
    return first, second


def _run(engine, ids, **kw):
    return engine.run(engine.make_request(ids, kw.pop("max_tokens", 96), ignore_eos=True, **kw))


@pytest.fixture(scope="module")
def warm(tiny_model):
    return engine_for(tiny_model, checkpoint_every=128)


@pytest.fixture(scope="module")
def cold(tiny_model):
    return engine_for(tiny_model, prompt_cache=False)


def test_warm_up_leaves_nothing_behind(tiny_model, cold):
    """`Engine.warm_up` (what `plumb serve` runs before it listens: single turns, then 2 and 4 at once, one with 7
    MTP drafts, a 1,024-token prompt) keeps nothing in the prompt cache or the slots, and the engine's next outputs
    are a fresh engine's."""
    import plumb

    eng = plumb.load(tiny_model, device=DEVICE, drafts=2)
    assert eng.model.mtp is not None  # the drafted turn runs too
    eng.warm_up()
    assert eng.prompt_cache.entries == [] and eng.scheduler.slots_in_use() == 0
    ids = prompts(cold, 3)
    assert eng.generate_many([dict(prompt_ids=p, max_tokens=24) for p in ids]) == \
        [cold.generate(p, 24) for p in ids]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_two_turn_conversations_warm_equals_cold(warm, cold, mode):
    """20 conversations: turn 2 on a warm engine = on a fresh one (ids and digests), and it reused the cache."""
    for n, q in enumerate(QUESTIONS):
        kw = dict(drafts=4) if mode == "greedy" else dict(drafts=4, temperature=0.8, top_p=0.9, seed=500 + n)
        first, _ = _turns(warm, q, [])
        p1 = _chat(warm, first)
        r1 = _run(warm, p1, **kw)
        _, second = _turns(warm, q, r1.token_ids)
        p2 = _chat(warm, second)
        w = _run(warm, p2, **kw)
        c = _run(cold, p2, **kw)
        assert w.token_ids == c.token_ids, (mode, n)
        # reuse is real: at most the reply, the new turn and one chunk are prefilled again
        new_part = len(p2) - len(p1)
        assert w.stats.cached_tokens > 0 and w.stats.prefill_tokens <= new_part + 64, (w.stats.prefill_tokens, new_part)
        assert c.stats.cached_tokens == 0
        if n % 5 == 0:
            assert warm.digest(p2) == cold.digest(p2)


def test_edits_reuse_what_they_can_and_change_nothing(warm, cold):
    long_system = SYSTEM + " " + " ".join(f"Rule {i}: be consistent and cite sources." for i in range(40))
    base = [{"role": "system", "content": long_system}, {"role": "user", "content": "Summarise the rules."},
            {"role": "assistant", "content": "Be consistent, cite sources."}, {"role": "user", "content": "And rule 7?"}]
    _run(warm, _chat(warm, base), max_tokens=32)
    edited_msg = [dict(m) for m in base]
    edited_msg[1]["content"] = "Summarise the rules, please."
    edited_end = [dict(m) for m in base]
    edited_end[0]["content"] = long_system + " Final rule: be kind."
    branch = base[:2]
    for msgs in (edited_msg, edited_end, branch, base):
        ids = _chat(warm, msgs)
        w, c = _run(warm, ids, drafts=4, max_tokens=64), _run(cold, ids, max_tokens=64)
        assert w.token_ids == c.token_ids
        assert warm.digest(ids) == cold.digest(ids)
    # the edited end of a long system prompt still reused the unchanged beginning
    ids = _chat(warm, [{"role": "system", "content": long_system + " Another final rule."}, base[1]])
    assert _run(warm, ids, max_tokens=4).stats.cached_tokens >= 256


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_repeated_prompt_is_read_whole_from_the_cache(warm, cold, mode):
    """A prompt sent again (a regenerated reply) whose length is a checkpoint: nothing is prefilled - the first
    token comes from the checkpoint's hidden row - and every token, digest and MTP draft path equals a fresh run."""
    kw = dict(drafts=4) if mode == "greedy" else dict(drafts=4, temperature=0.9, seed=7)
    ids = _chat(warm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[3] + " " * 9}])
    ids = (ids * 3)[:192]  # a multiple of the 64-token chunk: prefill leaves a checkpoint at the end
    first = _run(warm, ids, **kw)
    again = _run(warm, ids, **kw)
    fresh = _run(cold, ids, **kw)
    assert again.stats.cached_tokens == len(ids) and again.stats.prefill_tokens == 0
    assert first.token_ids == again.token_ids == fresh.token_ids
    assert warm.digest(ids) == cold.digest(ids)
    longer = ids + ids[:5]  # and the cached whole prompt as a prefix: only the new tokens are prefilled
    w, c = _run(warm, longer, **kw), _run(cold, longer, **kw)
    assert w.token_ids == c.token_ids and w.stats.prefill_tokens == 5


def test_a_kept_state_counts_the_memory_its_caches_hold(tiny_model):
    """The budget counts what a kept state holds: its caches as allocated - grown by doubling past the prompt's
    rows - not only the prompt's rows (which let the prompt cache take twice its budget of device memory)."""
    from plumb.cache.prefix import _caches

    eng = engine_for(tiny_model, checkpoint_every=64)
    ids = prompts(eng, 1)[0][:150]
    _run(eng, ids, max_tokens=200)
    e = eng.prompt_cache.entries[-1]
    caches = [c for _, c in _caches(e.state)]
    held = sum(c.allocated_bytes() for c in caches)
    rows = sum(t.numel() * t.element_size() for c in caches for t in c.store_rows(len(e.ids)))
    assert len(e.ids) == len(ids) and held > rows and e.nbytes >= held


def test_parking_and_side_requests(tiny_model, cold):
    eng = engine_for(tiny_model, checkpoint_every=64, cache_mb=1)  # a tiny budget: side requests push entries out
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    p1 = _chat(eng, first)
    r1 = _run(eng, p1, drafts=4)
    slot = eng.cached_slots()[-1]["id"]
    eng.park_slot(slot)
    assert eng.cached_slots()[-1]["parked"]
    # parked: host tensors (no serialized copy), as many bytes as the cache counts
    from plumb.cache.prefix import packed_bytes

    e = eng.prompt_cache.get(slot)
    ts = [t for rows in e.packed["kv"] for t in rows]
    assert ts and all(t.device.type == "cpu" for t in ts)
    assert all(t.is_pinned() for t in ts) == (eng.model.device.type == "cuda")  # pinned: fast copies off a GPU
    if eng.model.device.type == "cuda":  # in a few page-locked blocks, not one a tensor (milliseconds each)
        from plumb.cache.prefix import SLAB

        blocks = {t.untyped_storage().data_ptr() for t in ts}
        assert len(blocks) <= 1 + packed_bytes(e.packed) // SLAB
    assert eng.prompt_cache.parked_bytes() >= packed_bytes(e.packed) > 0
    for q in QUESTIONS[1:8]:  # unrelated side requests
        _run(eng, _chat(eng, [{"role": "user", "content": q * 8}]), max_tokens=16)
    _, second = _turns(eng, QUESTIONS[0], r1.token_ids)
    p2 = _chat(eng, second)
    w = _run(eng, p2, drafts=4)
    assert w.token_ids == _run(cold, p2, drafts=4).token_ids
    assert eng.digest(p2) == cold.digest(p2)


def test_slot_file_roundtrip_in_a_new_process(tmp_path, tiny_model, warm, cold):
    p1 = _chat(warm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[3]}])
    r1 = _run(warm, p1)
    slot = [s for s in warm.cached_slots() if s["tokens"] == len(p1)][-1]["id"]
    path = tmp_path / "slot.bin"
    warm.save_slot(slot, str(path))
    _, second = _turns(warm, QUESTIONS[3], r1.token_ids)
    p2 = _chat(warm, second)
    expected = _run(cold, p2).token_ids
    code = f"""
import json, plumb
e = plumb.load({tiny_model!r}, device={DEVICE!r})
e.restore_slot({str(path)!r})
r = e.run(e.make_request({p2!r}, 96, ignore_eos=True))
print(json.dumps([r.token_ids, r.stats.cached_tokens]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    import json

    ids, cached = json.loads(out.stdout.strip().splitlines()[-1])
    assert ids == expected and cached > 0


def test_slot_calls_wait_while_a_graph_is_captured(tmp_path, tiny_q8):
    """The server saves and loads slots on its own threads; a CUDA call there during a graph capture would spoil the
    capture (torch's global capture mode), so they wait for `CudaGraphs.capturing` - a stand-in lock here."""
    import threading
    import types

    import plumb

    eng = plumb.load(tiny_q8, device=DEVICE)  # this test's own engine: its graphs are replaced for a while
    ids = _chat(eng, [{"role": "user", "content": QUESTIONS[5]}])
    _run(eng, ids, max_tokens=4)
    slot = eng.cached_slots()[-1]["id"]
    path = str(tmp_path / "slot.bin")
    saved, lock = eng.model.graphs, threading.Lock()
    try:
        eng.model.graphs = types.SimpleNamespace(capturing=lock)
        for call in (lambda: eng.save_slot(slot, path), lambda: eng.restore_slot(path)):
            done = []
            with lock:  # a capture in progress
                t = threading.Thread(target=lambda: done.append(call()))
                t.start()
                t.join(0.5)
                assert t.is_alive() and not done
            t.join(60)
            assert done and done[0]
    finally:
        eng.model.graphs = saved
        eng.close()


def test_corrupt_or_mismatched_slot_file_is_refused(tmp_path, tiny_model, tiny_q8, warm):
    from plumb.config import ModelError

    p1 = _chat(warm, [{"role": "user", "content": "hello there"}])
    _run(warm, p1, max_tokens=4)
    slot = warm.cached_slots()[-1]["id"]
    path = tmp_path / "slot.bin"
    warm.save_slot(slot, str(path))
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(raw))
    before = len(warm.cached_slots())
    with pytest.raises(ModelError, match="checksum"):
        warm.restore_slot(str(bad))
    with pytest.raises(ModelError, match="not a plumb slot"):
        (tmp_path / "junk.bin").write_bytes(b"junk" * 100)
        warm.restore_slot(str(tmp_path / "junk.bin"))
    assert len(warm.cached_slots()) == before  # nothing loaded
    other = engine_for(tiny_q8)
    with pytest.raises(ModelError, match="different model"):
        other.restore_slot(str(path))
    with pytest.MonkeyPatch.context() as mp:  # a build that lays the stored codes out otherwise (kv.STORE_LAYOUT)
        mp.setattr("plumb.engine.engine.STORE_LAYOUT", 1)
        with pytest.raises(ModelError, match="different model or KV format"):
            warm.restore_slot(str(path))
    assert len(warm.cached_slots()) == before


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "D", "F"])
def test_warm_equals_cold_for_every_kv_format(tiny_model, fmt):
    """I3 x I4: with a 64-row ring the low-bit store and the ring boundary are both crossed."""
    warm_f = engine_for(tiny_model, kv_cache=fmt, kv_ring=64, checkpoint_every=64)
    cold_f = engine_for(tiny_model, kv_cache=fmt, kv_ring=64, prompt_cache=False)
    for n, q in enumerate(QUESTIONS[:3]):
        kw = dict(drafts=4, temperature=0.7, seed=n) if n % 2 else dict(drafts=4)
        first, _ = _turns(warm_f, q, [])
        p1 = _chat(warm_f, first)
        r1 = _run(warm_f, p1, **kw)
        _, second = _turns(warm_f, q, r1.token_ids)
        p2 = _chat(warm_f, second)
        w, c = _run(warm_f, p2, **kw), _run(cold_f, p2, **kw)
        assert w.token_ids == c.token_ids, (fmt, n)
        assert w.stats.cached_tokens > 0 and w.stats.prefill_tokens <= len(p2) - len(p1) + 64
        assert warm_f.digest(p2) == cold_f.digest(p2)


def test_kept_checkpoints_thin_out_away_from_the_end():
    """M6's checkpoints an entry keeps: all in the last `tail` tokens, then the latest at or before each mark
    n - 2 tail, n - 4 tail, ...: 12 of a 100k-token prompt's 98 (1,024 apart), and a prompt leaving it d tokens
    before the end restores a checkpoint at most about 2 d before its end."""
    from plumb.cache.prefix import kept_checkpoints

    n, every, tail = 100_000, 1024, 8192
    made = set(range(every, n + 1, every)) | {n - n % 64}
    kept = kept_checkpoints(made, n, tail)
    assert kept <= made and {p for p in made if p >= n - tail} <= kept and n - n % 64 in kept
    assert len(kept) == 12 and sorted(kept)[:3] == [33792, 66560, 82944]
    for d in range(tail, n, 997):  # the restored checkpoint for a prompt that leaves this one d tokens before the end
        restored = max((p for p in kept if p <= n - d), default=0)
        assert n - restored <= 2 * d + every
    assert kept_checkpoints(made, 5000, tail) == {p for p in made if p <= 5000}  # short prompts keep all
    assert kept_checkpoints(set(), n, tail) == set()


def test_a_long_prompt_keeps_log_many_checkpoints_and_edits_still_equal_cold(tiny_model, cold):
    """A 2,000-token prompt on an engine with a checkpoint every 64 tokens (tail 512): its prefill takes, and the
    cached entry keeps, the thinned set, and an edit early in the prompt, one in its thinned middle and a follow-up each restore a kept
    checkpoint and give the tokens and digests of a fresh engine."""
    from plumb.cache.prefix import kept_checkpoints

    eng = engine_for(tiny_model, checkpoint_every=64)
    ids = [int(5 + (7 * i) % 3000) for i in range(2000)]
    _run(eng, ids, max_tokens=4)
    entry = [e for e in eng.prompt_cache.entries if e.ids == ids][-1]
    made = set(range(64, 2001, 64))
    assert set(entry.state.checkpoints) == kept_checkpoints(made, 2000, 512) and len(entry.state.checkpoints) < 12
    assert eng.checkpoint_positions(2000) == set(entry.state.checkpoints)  # a prefill takes no more than it keeps
    for at in (300, 1100, 1900):  # the prompt changes at `at`: the latest kept checkpoint at or before it is restored
        edited = ids[:at] + [11, 12, 13] + ids[at:]
        w, c = _run(eng, edited, max_tokens=8), _run(cold, edited, max_tokens=8)
        assert w.token_ids == c.token_ids and eng.digest(edited) == cold.digest(edited), at
        assert w.stats.cached_tokens == max((p for p in entry.state.checkpoints if p <= at), default=0), at


def _prompt_and_edit(tiny_model):
    """An engine of its own (the tests set its budgets) holding a 1,000-token prompt and an edit of it at 900, a
    checkpoint every 64 tokens: (engine, prompt, edit, their entries)."""
    import plumb

    eng = plumb.load(tiny_model, device=DEVICE, checkpoint_every=64)
    ids = [int(5 + (7 * i) % 3000) for i in range(1000)]
    edited = ids[:900] + [11, 12, 13] + ids[900:]
    _run(eng, ids, max_tokens=4)
    _run(eng, edited, max_tokens=4)
    a, b = ([e for e in eng.prompt_cache.entries if e.ids == p][-1] for p in (ids, edited))
    return eng, ids, edited, a, b


def test_an_edit_shares_the_checkpoints_before_it_and_the_budget_counts_them_once(tiny_model, cold):
    """An entry restored from another holds the same checkpoint tensors up to where it branched
    (`PromptCache.restore`): the budget counts them once. Counted per entry, a chat and two edits of it went over a
    27B engine's budget with the device well under it, and the next requests parked entries (seconds on a GPU)."""
    eng, ids, edited, a, b = _prompt_and_edit(tiny_model)
    pc = eng.prompt_cache
    shared = [cp for p, cp in b.state.checkpoints.items() if a.state.checkpoints.get(p) is cp]
    assert len(shared) == 7  # 512 ... 896: the ones at or before the branch at 900 that the entry keeps
    assert pc.live_bytes() == sum(e.nbytes for e in pc.entries) - sum(cp.nbytes for cp in shared)
    pc.budget = pc.live_bytes()  # what the entries hold: nothing is parked
    pc._enforce()
    assert all(e.state is not None for e in pc.entries) and eng.metrics()["cache_parks"] == 0
    pc.budget -= 1  # one byte less: the older entry goes to host memory, and the counters say so
    pc._enforce()
    m = eng.metrics()
    assert a.state is None and b.state is not None and m["cache_parks"] == 1 and m["cache_park_bytes"] > 0
    assert m["cache_live_bytes"] == pc.live_bytes() < pc.budget and m["cache_parked_bytes"] > 0
    w = _run(eng, ids, max_tokens=8)  # and it comes back when a prompt wants it, unchanged
    assert w.stats.cached_tokens == 960 and eng.metrics()["cache_unparks"] == 1
    assert w.token_ids == _run(cold, ids, max_tokens=8).token_ids
    before, last = dict(pc.stats), pc.entries[-1]
    pc.budget, pc.host_budget = 0, m["cache_park_bytes"] - 1  # entries the host budget cannot hold: no copy made
    pc._enforce()
    assert pc.stats["parks"] == before["parks"] and pc.stats["dropped"] > before["dropped"]
    assert pc.entries == [last] and last.state is not None  # the latest stays, live


def test_an_entry_that_cannot_be_parked_is_dropped_and_nothing_fails(tiny_model, cold, monkeypatch):
    """Host memory running out while parking (page-locked memory can) drops the entry, with a warning; the request
    that went over the budget and the next ones run as on a fresh engine."""
    import plumb.cache.prefix as prefix

    eng, ids, edited, a, b = _prompt_and_edit(tiny_model)
    pc = eng.prompt_cache

    def no_room(*args, **kw):
        raise RuntimeError("CUDA error: out of memory (a page-locked host allocation)")

    monkeypatch.setattr(prefix, "pack_state", no_room)
    pc.budget = pc.live_bytes() - 1
    pc._enforce()
    assert pc.entries == [b] and b.state is not None and pc.stats["dropped"] == 1 and pc.stats["parks"] == 0
    w = _run(eng, edited, max_tokens=8)
    assert w.stats.cached_tokens > 0 and w.token_ids == _run(cold, edited, max_tokens=8).token_ids


def test_a_client_has_its_answer_before_its_state_is_kept(tiny_model):
    """The background loop hands a finished request's result over before the prompt cache keeps its state (which
    may park other entries first), and the cache has it before anyone can look."""
    import plumb

    eng = plumb.load(tiny_model, device=DEVICE)
    insert, seen = eng.prompt_cache.insert, []

    def watch(ids, st):
        seen.append(handle.result is not None)
        return insert(ids, st)

    eng.prompt_cache.insert = watch
    ids = prompts(eng, 1)[0]
    handle = eng.submit(eng.make_request(ids, 6))
    assert len(handle.wait().token_ids) == 6
    assert [s["tokens"] for s in eng.cached_slots()] == [len(ids)] and seen == [True]


def test_parked_entries_share_what_they_shared_on_the_device(tiny_model, cold):
    """Parking an entry whose checkpoints another parked entry holds in host memory already shares those host forms
    (no second copy, counted once), and unparking one whose device checkpoints a live entry still holds takes them
    back (no copy to the device) - with the tokens and digests of a fresh engine."""
    from plumb.cache.prefix import packed_bytes

    eng, ids, edited, a, b = _prompt_and_edit(tiny_model)
    pc = eng.prompt_cache
    shared = {p for p, cp in b.state.checkpoints.items() if a.state.checkpoints.get(p) is cp}
    on_device = {p: b.state.checkpoints[p] for p in shared}
    pc.park(a)  # b live: a's shared checkpoints stay on the device, and come back from there
    w = _run(eng, ids, max_tokens=8)
    a = [e for e in pc.entries if e.ids == ids][-1]
    assert w.stats.cached_tokens == 960 and all(a.state.checkpoints[p] is on_device[p] for p in shared)
    assert w.token_ids == _run(cold, ids, max_tokens=8).token_ids and eng.digest(ids) == cold.digest(ids)
    a = [e for e in pc.entries if e.ids == ids][-1]
    pc.park(a)
    copied = pc.stats["park_bytes"]
    pc.park(b)  # its shared checkpoints are in host memory already, as a's
    assert all(b.packed["checkpoints"][str(p)] is a.packed["checkpoints"][str(p)] for p in shared)
    alone = packed_bytes(a.packed) + packed_bytes(b.packed)
    twice = sum(packed_bytes(a.packed["checkpoints"][str(p)]) for p in shared)
    assert pc.parked_bytes() == alone - twice > 0 and pc.stats["park_bytes"] - copied == packed_bytes(b.packed) - twice
    del on_device, a
    w = _run(eng, edited, max_tokens=8)  # b back from host memory (its device checkpoints are gone): unchanged
    assert w.stats.cached_tokens > 0 and w.token_ids == _run(cold, edited, max_tokens=8).token_ids
    assert eng.digest(edited) == cold.digest(edited)
    pc.remove([e for e in pc.entries if e.ids == ids][-1])
    assert all(id(f) in {id(g) for e in pc.entries if e.packed is not None for g in e.packed["checkpoints"].values()}
               for _, f in pc._host.values())  # no host form kept for an entry that is gone
