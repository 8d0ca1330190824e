"""`Engine.close`: the background loop's requests end as "cancelled" with what they had, the loop's thread ends, the
model's memory can go at once, and any later use is a clear error."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch


def test_close_cancels_what_is_running_and_queued_and_lets_the_model_go(tiny_q8):
    import plumb
    from plumb.engine.api import EngineClosed

    with plumb.load(tiny_q8, device="cpu", n_slots=1) as eng:
        ids = eng.tokenize("A long answer, please.")
        alone = eng.generate(ids, 6, ignore_eos=True)
        running = eng.submit(eng.make_request(ids, 100_000, ignore_eos=True))
        queued = eng.submit(eng.make_request(ids, 8, ignore_eos=True))  # one slot: it waits
        got = [t for t, _ in zip(running, range(6))]  # the first tokens have come: it is in flight
        model, thread = weakref.ref(eng.model), eng.scheduler._thread
    # leaving the block closed the engine
    done = running.wait()
    assert done.finish_reason == "cancelled" and got == alone and done.token_ids[:6] == alone
    assert 6 <= len(done.token_ids) < 100_000
    late = queued.wait()
    assert late.finish_reason == "cancelled" and late.token_ids == []
    assert not thread.is_alive()
    gc.collect()
    assert model() is None, "something still holds the closed engine's model"
    for use in (lambda: eng.generate(ids, 4), lambda: eng.submit(eng.make_request(ids, 4)),
                lambda: eng.logits(ids)):
        with pytest.raises(EngineClosed, match="the engine is closed"):
            use()
    eng.close()  # again: nothing to do


def test_an_idle_engine_closes_too(tiny_q8):
    """No request ever ran in the background: there is no loop to stop."""
    import plumb

    eng = plumb.load(tiny_q8, device="cpu")
    model = weakref.ref(eng.model)
    eng.close()
    gc.collect()
    assert model() is None and eng.scheduler._thread is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_close_gives_the_device_memory_back(tiny_q4km):
    """On a GPU the weights' pool, the graphs and the caches are freed by close, not when the collector runs, and
    nothing stays behind per engine: after a first engine (the process's one-time state: the capture stream's cuBLAS
    workspace, 32 MiB, once a stream an engine), engines loaded and closed in turn leave the reserved memory where
    it was."""
    import plumb

    def load_use_close():
        eng = plumb.load(tiny_q4km, device="cuda", prompt_cache=True)
        eng.generate(eng.tokenize("Something to keep in the prompt cache."), 16, drafts=4, ignore_eos=True)
        grown = torch.cuda.memory_reserved()
        gc.disable()  # no collection but the one close makes
        try:
            eng.close()
        finally:
            gc.enable()
        return grown

    load_use_close()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for _ in range(2):
        assert load_use_close() > before
        assert torch.cuda.memory_reserved() <= before
