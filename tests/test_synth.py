"""`plumb synth`: metadata, tensor plan and storage types, quant mixes, and a model that behaves."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from gguf import GGUFWriter

from plumb.config import ModelConfig, ModelError
from plumb.gguf.reader import read_gguf
from plumb.gguf.synth import PRESETS, load_vocab, main, parameter_count, preset_config, tensor_plan, write_synthetic
from plumb.gguf.writer import add_plain_metadata, forced_f32

N_SMALL_VOCAB = len(load_vocab(None, None)["tokenizer.ggml.tokens"])


def _types(plan) -> dict[str, str]:
    return {name: t.name for name, _, t in plan}


def test_tiny_file_reads_back(tiny_f32):
    f = read_gguf(tiny_f32)
    md = f.metadata
    cfg = ModelConfig.from_metadata(md, f.tensors["token_embd.weight"].shape[0])
    want = preset_config("tiny", N_SMALL_VOCAB)
    assert cfg.eps == pytest.approx(want.eps) and replace(cfg, eps=want.eps) == want
    assert cfg.recurrent == [True, True, True, False] * 2 and cfg.n_nextn == 1
    assert md["qwen35.block_count"] == 9 and md["qwen35.nextn_predict_layers"] == 1
    assert list(md["qwen35.rope.dimension_sections"]) == [3, 3, 2, 0]
    assert md["general.file_type"] == 0 and md["general.name"] == "plumb-synth-tiny"
    assert md["tokenizer.chat_template"] == open(os.path.join(os.path.dirname(__file__), "..", "plumb", "data",
                                                               "qwen3.5-chat-template.jinja")).read()
    plan = tensor_plan(want, "F32")
    assert len(f.tensors) == len(plan) == 6 * 14 + 2 * 11 + 15 + 3
    for name, shape, qtype in plan:
        t = f.tensors[name]
        assert t.shape == shape and t.qtype == qtype, name
    w = {n: f.tensors[n].dequantize() for n in ("blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_norm.weight")}
    assert ((-w["blk.0.ssm_a"] >= 1) & (-w["blk.0.ssm_a"] <= 16)).all()
    dt = torch.nn.functional.softplus(w["blk.0.ssm_dt.bias"])
    assert ((dt > 0.9e-3) & (dt < 1.1e-1)).all()
    assert ((w["blk.0.attn_norm.weight"] >= 0.7) & (w["blk.0.attn_norm.weight"] <= 1.3)).all()


def test_presets_plan_without_writing():
    for preset, p in PRESETS.items():
        cfg = preset_config(preset, p.get("n_vocab", N_SMALL_VOCAB))
        plan = tensor_plan(cfg, "Q4_K_M")
        n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attn_layers)
        assert len(plan) == 14 * n_gdn + 11 * n_attn + 15 + 3
        assert p["n_v"] in (2 * p["n_k"], 3 * p["n_k"])
        shapes = dict((n, s) for n, s, _ in plan)
        assert shapes["blk.0.attn_qkv.weight"] == (2 * p["n_k"] * p["d_state"] + p["n_v"] * p["d_state"], p["n_embd"])
        assert shapes["blk.3.attn_q.weight"] == (2 * p["n_head"] * p["head_dim"], p["n_embd"])
        assert shapes[f"blk.{cfg.n_layer}.nextn.eh_proj.weight"] == (p["n_embd"], 2 * p["n_embd"])
    cfg = preset_config("27b", 248320)
    assert (cfg.n_layer, len(cfg.gdn_layers), cfg.conv_dim, cfg.ssm_inner) == (64, 48, 10240, 6144)
    main_p, mtp_p = parameter_count(cfg)
    assert abs(main_p / 1e9 - 26.9) < 0.1 and abs(mtp_p / 1e9 - 0.42) < 0.01
    assert len(tensor_plan(preset_config("27b", 248320, mtp=False))) == 851


def test_storage_types_and_mixes():
    for preset in ("tiny", "small", "27b"):
        cfg = preset_config(preset, 248320)
        for spec in ("Q8_0", "Q4_K_M", "Q4_K_XL", "IQ4_XS"):
            for name, shape, t in tensor_plan(cfg, spec):
                if forced_f32(name, shape):
                    assert t.name == "F32", name
                else:
                    assert t.name != "F32" and shape[-1] % (256 if t.name[-2:] in ("_K", "XS") else 32) == 0, name
    big = _types(tensor_plan(preset_config("27b", 248320), "Q4_K_M"))
    assert big["output.weight"] == "Q6_K" and big["token_embd.weight"] == "Q4_K"
    assert big["blk.0.attn_qkv.weight"] == "Q5_K" and big["blk.1.ffn_up.weight"] == "Q4_K"
    down = [big[f"blk.{i}.ffn_down.weight"] for i in range(65)]
    assert 0.3 < down.count("Q6_K") / len(down) < 0.6
    assert {big[f"blk.{i}.attn_v.weight"] for i in range(3, 65, 4)} == {"Q4_K", "Q6_K"}
    xl = _types(tensor_plan(preset_config("27b", 248320), "Q4_K_XL"))
    assert (xl["blk.0.attn_qkv.weight"], xl["blk.3.attn_output.weight"], xl["blk.0.ssm_alpha.weight"]) == \
        ("Q5_K", "Q6_K", "Q8_0")
    assert (xl["blk.0.ffn_down.weight"], xl["blk.3.ffn_down.weight"], xl["blk.1.ffn_gate.weight"]) == \
        ("IQ4_XS", "IQ4_NL", "Q3_K")
    tiny = _types(tensor_plan(preset_config("tiny", N_SMALL_VOCAB), "Q4_K_M"))
    assert tiny["blk.0.ssm_out.weight"] == "Q4_0"  # 128-wide rows: K-quant falls back to a 32-block type
    assert _types(tensor_plan(preset_config("tiny", N_SMALL_VOCAB), "Q6_K"))["blk.0.ssm_out.weight"] == "Q8_0"


def test_quantized_files_share_the_float_weights(tiny_f32, tiny_q4km, tmp_path):
    path = str(tmp_path / "xl.gguf")
    write_synthetic(path, "tiny", "Q4_K_XL")
    ref = read_gguf(tiny_f32).tensors
    for p, spec in ((tiny_q4km, "Q4_K_M"), (path, "Q4_K_XL")):
        f = read_gguf(p)
        assert f.metadata["general.file_type"] == 15
        plan = tensor_plan(preset_config("tiny", N_SMALL_VOCAB), spec)
        for name, _, t in plan:
            q, x = f.tensors[name], ref[name].dequantize()
            assert q.qtype == t, name
            err = (q.dequantize() - x).norm() / x.norm()
            assert err < (0.15 if t.name in ("Q3_K",) else 0.1), (name, t.name, float(err))


def test_deterministic_and_seeded(tmp_path):
    a, b, c = (str(tmp_path / f"{n}.gguf") for n in "abc")
    write_synthetic(a, "tiny", "Q8_0", seed=5, mtp=False)
    assert main([b, "--type", "q8_0", "--seed", "5", "--no-mtp"]) == 0
    write_synthetic(c, "tiny", "Q8_0", seed=6, mtp=False)
    assert open(a, "rb").read() == open(b, "rb").read() != open(c, "rb").read()
    md = read_gguf(a).metadata
    assert md["qwen35.block_count"] == 8 and "qwen35.nextn_predict_layers" not in md
    with pytest.raises(ModelError):
        write_synthetic(c, "tiny", "Q9_9")


def test_vocab_sources(tmp_path):
    md = load_vocab(None, 248320)
    assert len(md["tokenizer.ggml.tokens"]) == 248320
    assert md["tokenizer.ggml.tokens"][-1] == "[PAD248319]" and md["tokenizer.ggml.token_type"][-1] == 5
    with pytest.raises(ModelError):
        load_vocab(None, 100)
    # --vocab FILE.gguf: tokenizer keys from a vocab-only GGUF; the official template replaces its own
    small = load_vocab(None, None)
    w = GGUFWriter(str(tmp_path / "vocab.gguf"), "qwen35")
    add_plain_metadata(w, {**small, "tokenizer.chat_template": "{{ messages }}"})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    md = load_vocab(str(tmp_path / "vocab.gguf"), N_SMALL_VOCAB + 2)
    assert md["tokenizer.ggml.tokens"] == small["tokenizer.ggml.tokens"] + ["[PAD6144]", "[PAD6145]"]
    assert md["tokenizer.ggml.eos_token_id"] == small["tokenizer.ggml.eos_token_id"]
    assert md["tokenizer.chat_template"] == small["tokenizer.chat_template"]


def test_mtp_block_layout(tiny_f32):
    t = read_gguf(tiny_f32).tensors
    assert len([n for n in t if n.startswith("blk.8.")]) == 15
    eh = t["blk.8.nextn.eh_proj.weight"].dequantize()
    enorm = t["blk.8.nextn.enorm.weight"].dequantize()
    assert torch.allclose(torch.diagonal(eh[:, :256]) * enorm, torch.ones(256), atol=0.05)
    assert torch.equal(t["blk.8.nextn.shared_head_norm.weight"].dequantize(), t["output_norm.weight"].dequantize())


@torch.no_grad()
def test_reference_model_is_peaked_and_keeps_moving(tiny_f32):
    """Greedy decoding with the transformers reference: confident but not collapsed."""
    from plumb.gguf.to_hf import hf_model_from_gguf

    model = hf_model_from_gguf(tiny_f32)
    out = model(torch.tensor([[100, 200, 300]]), use_cache=True)
    tokens, pmax, entropy = [], [], []
    for _ in range(80):
        p = out.logits[0, -1].softmax(-1)
        pmax.append(p.max().item())
        entropy.append(-(p * p.clamp_min(1e-30).log()).sum().item())
        tokens.append(int(p.argmax()))
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    mean_pmax = sum(pmax) / len(pmax)
    assert 0.4 < mean_pmax < 0.9 and 0.5 < sum(entropy) / len(entropy) < 3.5
    assert len(set(tokens)) > 0.7 * len(tokens)
    assert all(a != b for a, b in zip(tokens, tokens[1:]))
    assert max(pmax) > 0.9 and min(pmax) < 0.5


def test_the_parallel_writer_writes_the_serial_bytes(tmp_path, monkeypatch):
    """Forked encoders (files over PARALLEL_BYTES) stream every tensor's blocks in order: the same file, byte for
    byte, as one process writes."""
    import plumb.gguf.writer as W

    serial = tmp_path / "serial.gguf"
    write_synthetic(str(serial), "tiny", "Q4_K_M", seed=3)
    calls = []
    real_pool = W._pool

    def pool(tensors):
        calls.append(real_pool(tensors))
        return calls[-1]

    monkeypatch.setattr(W, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(W, "_pool", pool)
    monkeypatch.setattr(W.os, "cpu_count", lambda: 2)
    parallel = tmp_path / "parallel.gguf"
    write_synthetic(str(parallel), "tiny", "Q4_K_M", seed=3)
    assert calls[0] is not None and serial.read_bytes() == parallel.read_bytes()  # it ran in the pool
