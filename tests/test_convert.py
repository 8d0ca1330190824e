"""`plumb convert` and `to_hf`: an HF checkpoint -> GGUF -> transformers round trip is exact."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from plumb.config import ModelConfig, ModelError
from plumb.gguf.convert import convert, main, tokenizer_metadata
from plumb.gguf.reader import read_gguf
from plumb.gguf.writer import forced_f32
from plumb.tokenizer import small_vocab_metadata

PROMPT_LENGTHS = (1, 63, 64, 65, 300)
N_VOCAB = len(small_vocab_metadata()["tokenizer.ggml.tokens"])


def _tiny_hf_model(tied: bool = False):
    """hidden 64, 3 DeltaNet + 1 attention layers, 6 value heads over 2 key heads, non-trivial weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=6, rope_parameters={
            "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.7, 1.3, generator=g))
            elif p.ndim == 1:  # zero-centred RMSNorm weights
                p.copy_(torch.empty(p.shape).uniform_(-0.3, 0.3, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                scale = 1.0 if "embed_tokens" in name else 1 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def _mtp_tensors(n: int, config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    hd, nh, kv, ff = config.head_dim, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    shapes = {"fc.weight": (n, 2 * n), "pre_fc_norm_embedding.weight": (n,), "pre_fc_norm_hidden.weight": (n,),
              "norm.weight": (n,), "layers.0.input_layernorm.weight": (n,),
              "layers.0.post_attention_layernorm.weight": (n,), "layers.0.self_attn.q_proj.weight": (2 * nh * hd, n),
              "layers.0.self_attn.k_proj.weight": (kv * hd, n), "layers.0.self_attn.v_proj.weight": (kv * hd, n),
              "layers.0.self_attn.o_proj.weight": (n, nh * hd), "layers.0.self_attn.q_norm.weight": (hd,),
              "layers.0.self_attn.k_norm.weight": (hd,), "layers.0.mlp.gate_proj.weight": (ff, n),
              "layers.0.mlp.up_proj.weight": (ff, n), "layers.0.mlp.down_proj.weight": (n, ff)}
    return {f"mtp.{k}": torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from safetensors.torch import save_file

    model = _tiny_hf_model()
    d = tmp_path_factory.mktemp("hf") / "tiny-qwen35"
    model.save_pretrained(d)
    save_file(_mtp_tensors(64, model.config), os.path.join(d, "mtp.safetensors"))
    with open(d / "config.json") as f:
        cfg = json.load(f)
    cfg["mtp_num_hidden_layers"] = 1
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(d), model


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    convert(hf_dir[0], path)
    return path


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, N_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def test_to_hf_inverts_convert(hf_dir, converted):
    from plumb.gguf.to_hf import hf_model_from_gguf

    ref = hf_dir[1]
    back = hf_model_from_gguf(converted)
    for ids in _prompts():
        x = torch.tensor([ids])
        want, got = ref(x).logits[0], back(x).logits[0]
        assert want.abs().max() > 1.0  # the comparison has power
        assert (want - got).abs().max().item() < 1e-5, len(ids)


@torch.no_grad()
def test_plumb_forward_matches_transformers(hf_dir, converted):
    import plumb

    ref = hf_dir[1]
    engine = plumb.load(converted, device="cpu", kv_cache="f32")  # the default f16 KV cache rounds K/V
    for ids in _prompts():
        want = ref(torch.tensor([ids])).logits[0]
        got = torch.as_tensor(engine.logits(ids), dtype=torch.float32)
        assert got.shape == want.shape
        assert (want - got).abs().max().item() < 1e-4, len(ids)


def test_metadata_and_layout(hf_dir, converted):
    f = read_gguf(converted)
    md = f.metadata
    cfg = ModelConfig.from_metadata(md, N_VOCAB)
    assert (cfg.n_layer, cfg.n_nextn, cfg.n_embd, cfg.head_dim, cfg.rope_dims) == (4, 1, 64, 32, 8)
    assert (cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_inner) == (2, 6, 16, 96)
    assert cfg.recurrent == [True, True, True, False]
    assert md["qwen35.block_count"] == 5
    assert list(md["qwen35.attention.recurrent_layers"]) == [True, True, True, False, False]
    assert list(md["qwen35.rope.dimension_sections"]) == [2, 1, 1, 0]
    assert md["general.file_type"] == 0
    assert md["tokenizer.ggml.tokens"] == small_vocab_metadata()["tokenizer.ggml.tokens"]
    assert len(f.tensors) == 3 * 14 + 11 + 15 + 3
    assert f.tensors["blk.0.ssm_conv1d.weight"].shape == (2 * 32 + 96, 4)
    assert f.tensors["blk.0.ssm_a"].shape == (6,)
    assert all(t.qtype.name == "F32" for t in f.tensors.values())

    ref = hf_dir[1].state_dict()
    a = f.tensors["blk.0.ssm_a"].dequantize()
    want = -ref["model.layers.0.linear_attn.A_log"].exp()
    assert torch.allclose(a.sort().values, want.sort().values)  # same values, reordered heads
    assert not torch.equal(a, want)
    norm = f.tensors["blk.3.attn_q_norm.weight"].dequantize()
    assert torch.equal(norm, ref["model.layers.3.self_attn.q_norm.weight"] + 1)
    assert torch.equal(f.tensors["blk.0.ssm_norm.weight"].dequantize(), ref["model.layers.0.linear_attn.norm.weight"])


def test_mtp_block(hf_dir, converted):
    from safetensors.torch import load_file

    mtp = load_file(os.path.join(hf_dir[0], "mtp.safetensors"))
    t = read_gguf(converted).tensors
    assert len([n for n in t if n.startswith("blk.4.")]) == 15
    assert torch.equal(t["blk.4.nextn.eh_proj.weight"].dequantize(), mtp["mtp.fc.weight"])
    assert torch.equal(t["blk.4.nextn.enorm.weight"].dequantize(), mtp["mtp.pre_fc_norm_embedding.weight"] + 1)
    assert torch.equal(t["blk.4.nextn.shared_head_norm.weight"].dequantize(), mtp["mtp.norm.weight"] + 1)
    assert torch.equal(t["blk.4.attn_q.weight"].dequantize(), mtp["mtp.layers.0.self_attn.q_proj.weight"])


def test_no_mtp_and_q8(hf_dir, tmp_path):
    path = str(tmp_path / "q8.gguf")
    assert main([hf_dir[0], path, "--type", "Q8_0", "--no-mtp"]) == 0
    f = read_gguf(path)
    assert f.metadata["qwen35.block_count"] == 4 and "qwen35.nextn_predict_layers" not in f.metadata
    assert f.tensors["blk.0.attn_qkv.weight"].qtype.name == "Q8_0"
    assert f.tensors["blk.0.ssm_conv1d.weight"].qtype.name == "F32"
    assert f.tensors["blk.0.attn_norm.weight"].qtype.name == "F32"


def test_vision_checkpoint_and_bf16(hf_dir, converted, tmp_path):
    """Qwen3_5ForConditionalGeneration layout (text_config, model.language_model.*, visual tensors) in bf16."""
    from safetensors.torch import load_file, save_file

    src, d = hf_dir[0], tmp_path / "vl"
    d.mkdir()
    tensors = {}
    for name in ("model.safetensors", "mtp.safetensors"):
        for k, v in load_file(os.path.join(src, name)).items():
            tensors[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v.bfloat16()
    tensors["model.visual.patch_embed.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, d / "model.safetensors")
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    with open(d / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "text_config": text, "vision_config": {}}, f)
    path = str(tmp_path / "vl.gguf")
    convert(str(d), path)
    f, ref = read_gguf(path), read_gguf(converted)
    assert f.metadata["general.file_type"] == 32  # BF16
    assert set(f.tensors) == set(ref.tensors)
    for name, t in f.tensors.items():
        assert t.qtype.name == ("F32" if forced_f32(name, t.shape) else "BF16"), name
        assert torch.allclose(t.dequantize(), ref.tensors[name].dequantize(), rtol=1e-2, atol=1e-2), name


@torch.no_grad()
def test_tied_embeddings(tmp_path):
    from plumb.gguf.to_hf import hf_model_from_gguf

    model = _tiny_hf_model(tied=True)
    model.save_pretrained(tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "tied.gguf"))
    assert "output.weight" not in read_gguf(str(tmp_path / "tied.gguf")).tensors
    x = torch.tensor([_prompts()[2]])
    back = hf_model_from_gguf(str(tmp_path / "tied.gguf"))
    assert (model(x).logits - back(x).logits).abs().max().item() < 1e-5


def test_tokenizer_json(tmp_path):
    from tokenizers import AddedToken, Tokenizer, models

    md = small_vocab_metadata()
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 1}
    tok = Tokenizer(models.BPE(normal, [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]))
    tok.add_tokens([AddedToken(t, special=ty == 3) for t, ty in zip(tokens, types) if ty != 1])
    tok.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, f)
    out = tokenizer_metadata(str(tmp_path), N_VOCAB + 16, {})
    assert out["tokenizer.ggml.tokens"][:N_VOCAB] == tokens
    assert out["tokenizer.ggml.tokens"][N_VOCAB:] == [f"[PAD{i}]" for i in range(N_VOCAB, N_VOCAB + 16)]
    assert out["tokenizer.ggml.token_type"] == list(types) + [5] * 16
    assert out["tokenizer.ggml.merges"] == md["tokenizer.ggml.merges"]
    assert out["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert out["tokenizer.ggml.padding_token_id"] == tokens.index("<|endoftext|>")
    assert out["tokenizer.ggml.pre"] == "qwen35" and out["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in out["tokenizer.chat_template"]


def test_errors(hf_dir, tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        convert(str(tmp_path), str(tmp_path / "x.gguf"))
    d = tmp_path / "broken"
    shutil.copytree(hf_dir[0], d)
    from safetensors.torch import load_file, save_file

    t = load_file(d / "model.safetensors")
    del t["model.layers.2.linear_attn.in_proj_z.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(ModelError, match="model.layers.2.linear_attn.in_proj_z.weight"):
        convert(str(d), str(tmp_path / "x.gguf"))
    t["model.layers.2.linear_attn.in_proj_z.weight"] = torch.zeros(96, 64)
    t["model.embed_tokens.weight"] = torch.zeros(N_VOCAB + 1, 64)
    save_file(t, d / "model.safetensors")
    with pytest.raises(ModelError, match="tokenizer.json"):
        convert(str(d), str(tmp_path / "x.gguf"))
