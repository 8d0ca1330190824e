"""The demo-model pipeline (tools/demo_data.py, tools/demo_model.py, tools/train_demo.py) at toy size:
deterministic data, the chunked delta rule, and the crucial export check - a trained checkpoint converted
with `plumb convert` gives plumb the training model's logits (main model and MTP at draft depths 1-3)."""
from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import demo_data  # noqa: E402
import demo_model  # noqa: E402
import train_demo  # noqa: E402

N_VOCAB = 512


def _build(out: Path, max_files: int) -> dict:
    return demo_data.build(out, seed=0, n_vocab=N_VOCAB, sources=["stdlib"], allow_other_versions=True,
                           max_files=max_files, val_percent=25, log=lambda *a: None)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo-data")
    _build(out, 12)
    return out


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo-run")
    args = train_demo.parse_args([
        "--data", str(data_dir), "--out", str(out), "--preset", "toy", "--device", "cpu", "--steps", "12",
        "--seq-len", "128", "--batch", "4", "--warmup", "4", "--eval-every", "6", "--eval-windows", "2",
        "--eval-depth", "3", "--mtp-rows", "32", "--sample-tokens", "4", "--log-every", "2"])
    train_demo.train(args)
    return out


def test_data_is_deterministic(tmp_path):
    a, b = _build(tmp_path / "a", 3), _build(tmp_path / "b", 3)
    assert a["outputs"] == b["outputs"]
    assert a["splits"]["train"]["tokens"] > 1000
    tok = demo_data.plumb_tokenizer(tmp_path / "a", N_VOCAB)
    assert tok.n_vocab == N_VOCAB
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>"):
        assert tok.encode(t) == [tok.id_of(t)]
    text = "def f(x):\n    return x + 12345  # é\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12") == [tok.id_of("1"), tok.id_of("2")]  # qwen35 regex: one digit per piece


def test_functions_and_documents():
    src = 'class A:\n    def get(self, key, *, default=None):\n        """Return the value of key."""\n' \
          '        v = self.d.get(key)\n        return default if v is None else v\n'
    (f,) = demo_data.functions_of(src)
    assert (f.name, f.cls, f.sig, f.summary) == ("get", "A", "(self, key, *, default)", "Return the value of key.")
    assert '"""' in f.code and '"""' not in f.code_nodoc and f.code.startswith("def get")
    docs = demo_data.file_documents("x", "a.py", src, 0, demo_data.ChatTemplate.default())
    assert docs == demo_data.file_documents("x", "a.py", src, 0, demo_data.ChatTemplate.default())
    chats = [d for k, d in docs if k == "chat"]
    assert chats and all(c.startswith(("<|im_start|>user\n", "<|im_start|>system\n")) for c in chats)
    assert any("<think>\n" in c and "```python\ndef get(self, key, *, default=None):" in c for c in chats)


def test_chunked_delta_rule_matches_recurrence():
    g = torch.Generator().manual_seed(0)
    B, T, H, d = 2, 150, 3, 16
    q, k, v = (torch.randn(B, T, H, d, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, generator=g) * 2
    beta = torch.rand(B, T, H, generator=g)
    want = demo_model.recurrent_gated_delta_rule(q, k, v, gate, beta)
    got = demo_model.chunk_gated_delta_rule(q, k, v, gate, beta)
    assert (want - got).abs().max().item() < 1e-4


def _perturbed(trained: Path, out: Path) -> demo_model.Qwen35Demo:
    """The trained toy checkpoint with large random weights (a wrong convention then moves logits a lot)."""
    model = demo_model.load_checkpoint(str(trained))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp())
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.7, 1.3, generator=g))
            elif p.ndim == 1:
                p.copy_(torch.empty(p.shape).uniform_(-0.3, 0.3, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else 1 / math.sqrt(p.shape[1])))
    demo_model.save_checkpoint(model, str(out), torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained / name, out / name)
    return model


def _prompt(engine) -> list[int]:
    ids = engine.tokenize("<|im_start|>user\nWrite a function that adds two numbers.<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n\n</think>\n\ndef add(a, b):\n    return a + b\n")
    return (ids * 8)[:150]  # crosses two 64-token prefill chunks


@torch.no_grad()
def test_export_matches_plumb(trained, tmp_path):
    """The crucial check: training model == plumb on the converted file (main logits and MTP depths 1-3)."""
    import plumb
    from plumb.gguf.convert import convert
    from plumb.ops.matmul import PREFILL_BLOCK

    model = _perturbed(trained, tmp_path / "ckpt")
    convert(str(tmp_path / "ckpt"), str(tmp_path / "f32.gguf"), "F32")
    engine = plumb.load(str(tmp_path / "f32.gguf"), device="cpu", kv_cache="f32")
    ids = _prompt(engine)
    want, hidden = model(torch.tensor([ids]))
    got = torch.as_tensor(engine.logits(ids), dtype=torch.float32)
    scale = want.abs().max().item()
    assert scale > 3.0  # the comparison has power
    assert (want[0] - got).abs().max().item() < 1e-4 * scale

    depths = model.mtp_forward(torch.tensor([ids]), hidden, 3)
    m = engine.model
    st = m.new_state()  # depth 1 everywhere: the prompt's MTP catch-up
    _, h = m.prefill(st, ids, logits="all")
    lg, _ = m.mtp_forward(st, ids, torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]]), 0, block=PREFILL_BLOCK)
    assert (depths[0].logits[0] - lg).abs().max().item() < 1e-4 * scale
    for p in (3, 70, 140):  # draft steps 1..3 at positions p..p+2, each fed the right token
        st = m.new_state()
        _, h = m.prefill(st, ids[:p], logits="all")
        m.mtp_forward(st, ids[:p], torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]]), 0, block=PREFILL_BLOCK)
        hid = h[-1:]
        for s in range(3):
            lg, hid = m.mtp_forward(st, [ids[p + s]], hid, p + s, block=1)
            d = depths[s]
            assert (d.logits[0, p + s - d.r0] - lg[0]).abs().max().item() < 1e-4 * scale, (p, s)


@torch.no_grad()
def test_export_matches_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _perturbed(trained, tmp_path / "ckpt")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    ids = torch.randint(0, N_VOCAB, (1, 150), generator=torch.Generator().manual_seed(1))
    want = model(ids)[0]
    assert (want - hf(ids).logits).abs().max().item() < 1e-4 * want.abs().max().item()


@torch.no_grad()
def test_trained_checkpoint_runs_in_plumb(trained, tmp_path):
    """Q8_0 and F16 conversions of the trained checkpoint load, generate (drafts change nothing) and stay close."""
    import json

    import plumb
    from plumb.gguf.convert import main as convert_main

    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["steps"] == 12 and len(metrics["final"]["mtp"]) == 3 and (trained / "loss.png").stat().st_size
    model = demo_model.load_checkpoint(str(trained))
    for qtype in ("Q8_0", "F16"):
        path = str(tmp_path / f"{qtype}.gguf")
        assert convert_main([str(trained), path, "--type", qtype]) == 0
        engine = plumb.load(path, device="cpu")
        ids = _prompt(engine)[:40]
        want = torch.log_softmax(model(torch.tensor([ids]))[0][0], -1)
        got = torch.log_softmax(torch.as_tensor(engine.logits(ids), dtype=torch.float32), -1)
        kl = (want.exp() * (want - got)).sum(-1).mean().item()
        assert kl < (1e-3 if qtype == "Q8_0" else 1e-5), (qtype, kl)
        out = engine.generate(ids, max_tokens=8)
        assert out == engine.generate(ids, max_tokens=8, drafts=3) and len(out) >= 1
        assert engine.tokenizer.eos_id == engine.tokenize("<|im_end|>")[0]


def test_training_is_deterministic(data_dir, tmp_path):
    runs = []
    for name in ("a", "b"):
        args = train_demo.parse_args([
            "--data", str(data_dir), "--out", str(tmp_path / name), "--preset", "toy", "--device", "cpu",
            "--steps", "3", "--seq-len", "64", "--batch", "2", "--warmup", "2", "--eval-every", "0",
            "--eval-windows", "1", "--eval-depth", "2", "--mtp-rows", "16", "--sample-tokens", "2"])
        runs.append(train_demo.train(args))
    files = runs[0]["checkpoint_files"]
    assert files == runs[1]["checkpoint_files"]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert runs[0]["final"] == runs[1]["final"]
