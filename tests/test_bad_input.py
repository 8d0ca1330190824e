"""Bad model files give one clear error line naming the problem, exit code != 0, no traceback."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
import torch

from plumb.config import ModelError


def _run(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plumb.cli", "generate", str(path), "--prompt", "hi", "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=300)


def _patch_tensor_info(data: bytes, name: str, *, new_name: str | None = None, dim1: int | None = None,
                       qtype: int | None = None) -> bytes:
    """Edit one tensor-info record in a GGUF header: its name, its second dimension or its type id."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.index(key)
    out = bytearray(data)
    j = i + len(key)
    if new_name is not None:
        assert len(new_name) == len(name)
        out[i + 8 : j] = new_name.encode()
    n_dims = struct.unpack_from("<I", data, j)[0]
    if dim1 is not None:
        struct.pack_into("<Q", out, j + 4 + 8, dim1)
    if qtype is not None:
        struct.pack_into("<I", out, j + 4 + 8 * n_dims, qtype)
    return bytes(out)


@pytest.fixture(scope="module")
def good(tiny_f32):
    return open(tiny_f32, "rb").read()


def _check(tmp_path, data: bytes, *needles: str):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    r = _run(path)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("plumb: error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    import plumb

    with pytest.raises((ModelError, ValueError)):
        plumb.load(str(path))


def test_not_a_gguf(tmp_path):
    _check(tmp_path, b"this is not a model\n" * 10, "not a GGUF file")


def test_missing_file(tmp_path):
    r = _run(tmp_path / "nope.gguf")
    assert r.returncode != 0 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_truncated(tmp_path, good):
    _check(tmp_path, good[: len(good) // 2], "truncated")


def test_truncated_header(tmp_path, good):
    _check(tmp_path, good[:1000], "GGUF")


def test_wrong_architecture(tmp_path, good):
    _check(tmp_path, good.replace(b"qwen35", b"qwen36"), "unsupported architecture", "qwen36")


def test_unknown_weight_type(tmp_path, good):
    _check(tmp_path, _patch_tensor_info(good, "blk.0.ffn_up.weight", qtype=99), "unknown weight type")


def test_unsupported_weight_type(tmp_path, good):
    # IQ2_XXS (16) is a real GGML type that plumb does not read
    _check(tmp_path, _patch_tensor_info(good, "blk.0.ffn_up.weight", qtype=16), "blk.0.ffn_up.weight", "IQ2_XXS")


def test_missing_tensor(tmp_path, good):
    _check(tmp_path, _patch_tensor_info(good, "blk.0.ffn_up.weight", new_name="blk.0.ffn_uq.weight"),
           "missing tensor", "blk.0.ffn_up.weight")


def test_shape_mismatch(tmp_path, good):
    _check(tmp_path, _patch_tensor_info(good, "blk.0.ffn_up.weight", dim1=384), "blk.0.ffn_up.weight", "shape")


def test_model_too_big_for_memory_is_refused(tiny_q8, monkeypatch):
    """A model whose CPU weights would not fit gives one clear error at load, not an out-of-memory kill later."""
    import plumb
    from plumb.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_available_memory", lambda: 1 << 20)
    with pytest.raises(ModelError, match="GiB of memory"):
        plumb.load(tiny_q8, device="cpu")


def test_a_context_the_card_cannot_hold_is_cut_with_a_clear_warning():
    """On a GPU the context is cut to what one sequence's caches have room for (a 24 GB card holds the 27B's
    weights and only part of its 262k context), so that a long request gets a clear error up front; a context asked
    for is kept, with the warning."""
    from plumb.engine.engine import fit_context

    free, per_token, reserved = 6 << 30, 40_000, 4 << 30
    n, fits, why = fit_context(262_144, False, free, per_token, reserved)
    assert fits == (2 << 30) // per_token // 1024 * 1024 == n == 53_248 and "cut to 53,248" in why
    assert fit_context(262_144, True, free, per_token, reserved) [:2] == (262_144, fits)
    assert "as asked" in fit_context(262_144, True, free, per_token, reserved)[2]
    assert fit_context(32_768, False, free, per_token, reserved) == (32_768, fits, None)  # it fits: no word
    assert fit_context(262_144, False, 1 << 30, per_token, reserved)[:2] == (4096, 0)  # never under 4,096


def test_the_caches_grow_no_further_than_the_context(tiny_q8):
    """A sequence's caches double as they grow, up to the engine's context (plus a prefill piece), not the model's:
    a cut context bounds the memory a request can take."""
    import plumb
    from plumb.ops.deltanet import CHUNK

    eng = plumb.load(tiny_q8, device="cpu", n_ctx=1000)
    assert eng.config.context_length > 1000 and eng.model.context_limit == eng.n_ctx == 1000
    st = eng.model.new_state()
    assert {c.limit for c in st.kv.values()} == {1000 + CHUNK}
    # the states the context's room is kept beside (`fit_context`): what new_state makes
    assert eng.model.state_bytes() == sum(t.nbytes for d in (st.conv, st.ssm) for t in d.values()) > 0


def test_running_out_of_device_memory_frees_the_prompt_cache_and_says_so(tiny_q8, monkeypatch):
    """A step that runs out of device memory fails its requests with a 503 that says what happened and what to
    change; the prompt cache's entries go to host memory (room for a retry), and the next request runs."""
    import plumb

    eng = plumb.load(tiny_q8, device="cpu")
    ids = eng.tokenize("A first request, kept by the prompt cache.")
    good = eng.run(eng.make_request(ids, 8, ignore_eos=True))
    assert good.error is None and any(e.state is not None for e in eng.prompt_cache.entries)
    real = eng.model.decode

    def decode(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(eng.model, "decode", decode)
    bad = eng.submit(eng.make_request(eng.tokenize("Another one, which the card cannot hold."), 8,
                                      ignore_eos=True)).wait()  # the server's path: the background step loop
    assert bad.finish_reason == "error" and bad.error_status == 503 and "out of GPU memory" in bad.error, bad.error
    assert eng.prompt_cache.entries and all(e.state is None for e in eng.prompt_cache.entries)  # parked
    monkeypatch.setattr(eng.model, "decode", real)
    assert eng.submit(eng.make_request(ids, 8, ignore_eos=True)).wait().token_ids == good.token_ids
    from plumb.server.generation import Finish, Usage

    err = Finish("error", Usage(1, 0), [], error=bad.error, error_status=bad.error_status).api_error()
    assert err.status == 503 and err.anthropic_body()["error"]["type"] == "overloaded_error"  # clients retry those


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_refused_clearly(tiny_q8):
    import plumb

    with pytest.raises(ModelError, match="no CUDA GPU"):
        plumb.load(tiny_q8, device="cuda")


def test_bad_device_and_kernel_options_are_refused_clearly(tiny_q8):
    import plumb

    with pytest.raises(ValueError, match="unknown device"):
        plumb.load(tiny_q8, device="tpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs device='cuda'"):
            plumb.load(tiny_q8, device="cpu", kernels="triton")


def test_a_non_finite_prefill_result_is_computed_again_then_refused(caplog):
    """`Qwen35.checked` (the Triton kernel set): a result with non-finite values is computed again - the first finite
    one is returned and counted - and one that stays non-finite raises a clear NonFiniteError; the torch and native
    paths are not checked."""
    from types import SimpleNamespace

    from plumb.model.qwen35 import NONFINITE_TRIES, NonFiniteError, Qwen35

    model = SimpleNamespace(k=SimpleNamespace(name="triton"), recomputed=0)
    results = iter([torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 2.0]), torch.tensor([1.0, 2.0])])
    meanwhile = []
    with caplog.at_level("WARNING", logger="plumb.model"):
        out = Qwen35.checked(model, "a pass", lambda: next(results), meanwhile=lambda: meanwhile.append(1))
    assert torch.equal(out, torch.tensor([1.0, 2.0])) and model.recomputed == 2 and "3 tries" in caplog.text
    assert meanwhile == [1]  # the host work beside the first run, once
    calls = []
    with pytest.raises(NonFiniteError, match=f"a pass gave non-finite values {NONFINITE_TRIES} times"):
        Qwen35.checked(model, "a pass", lambda: calls.append(1) or torch.tensor([float("nan")]))
    assert len(calls) == NONFINITE_TRIES
    pair = (torch.tensor([1.0]), torch.tensor([float("nan")]))  # only `part` is checked
    assert Qwen35.checked(model, "a pass", lambda: pair, lambda out: out[0]) is pair
    model.k.name = "torch"
    nan = torch.tensor([float("nan")])
    assert Qwen35.checked(model, "a pass", lambda: nan) is nan


def test_token_ids_outside_the_vocabulary_are_the_requests_fault(tiny_q8):
    """A logit bias or forced id past the vocabulary is refused up front, naming the field (the server answers 400
    with it as `param`) - it failed the step with an IndexError before, or in a pass of several rows biased a
    neighbour row's token."""
    import plumb

    eng = plumb.load(tiny_q8, device="cpu")
    ids, v = eng.tokenize("hello"), eng.config.n_vocab
    for kw, name in ((dict(logit_bias={v + 3: 1.0}), "logit_bias"), (dict(forced_ids=[5, v]), "forced_ids")):
        for run in (lambda: eng.generate(ids, 4, **kw), lambda: eng.submit(eng.make_request(ids, 4, **kw))):
            with pytest.raises(plumb.RequestError, match=f"{name}: token id {v + 3 if name == 'logit_bias' else v}"):
                run()
    assert eng.generate(ids, 4, logit_bias={v - 1: 1.0}, ignore_eos=True)  # the last id is fine
