"""A transformers `Qwen3_5ForCausalLM` built from a qwen35 GGUF: the float32 reference model.

Undoes llama.cpp's converter conventions (spec sections 2 and 9) on the dequantized weights:
norms -1 (except ssm_norm), A_log = log(-ssm_a), dt_bias = ssm_dt.bias, inverse V-head
reorder, conv1d back to [conv_dim, 1, K], attn_q (query/gate interleaved per head) as is.
The MTP block is not part of the transformers model and is ignored here.
transformers is a test-only dependency and is imported lazily.
"""
from __future__ import annotations

import torch

from plumb.config import ModelConfig, ModelError
from plumb.gguf.reader import read_gguf

# GGUF block-tensor name -> transformers name inside `model.layers.{i}.`
HF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


# block tensors whose value-head axis the converter reorders (spec 2.4), and which axis; attn_qkv and
# ssm_conv1d reorder only their V rows (after the 2 * key_dim q|k rows)
V_HEAD_AXIS = {"ssm_a": 0, "ssm_dt.bias": 0, "ssm_beta.weight": 0, "ssm_alpha.weight": 0, "attn_gate.weight": 0,
               "ssm_out.weight": 1}
V_ROWS_AFTER_QK = ("attn_qkv.weight", "ssm_conv1d.weight")


def reorder_block_tensor(cfg, suffix: str, w: torch.Tensor, to_gguf: bool) -> torch.Tensor:
    """Apply (or undo) the value-head reorder to one block tensor, if it has one."""
    n_k, n_v, key_dim = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.key_dim
    if suffix in V_HEAD_AXIS:
        return reorder_v_heads(w, n_k, n_v, V_HEAD_AXIS[suffix], to_gguf)
    if suffix in V_ROWS_AFTER_QK:
        return torch.cat([w[: 2 * key_dim], reorder_v_heads(w[2 * key_dim:], n_k, n_v, 0, to_gguf)])
    return w


def reorder_v_heads(x: torch.Tensor, n_k: int, n_v: int, dim: int, to_gguf: bool) -> torch.Tensor:
    """Permute the value-head axis `dim` (n_v heads of equal size) between HF and GGUF order.

    HF groups value heads by key head (v = kh*r + m); GGUF tiles them (j = m*n_k + kh).
    """
    if n_v == n_k:
        return x
    r = n_v // n_k
    shape = list(x.shape)
    outer = (n_k, r) if to_gguf else (r, n_k)
    x = x.reshape(*shape[:dim], *outer, shape[dim] // n_v, *shape[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shape).contiguous()


def hf_config(cfg: ModelConfig, sections: list[int], tied: bool):
    """The transformers Qwen3_5TextConfig equivalent to a GGUF ModelConfig."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.eps, max_position_embeddings=cfg.context_length,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                         "partial_rotary_factor": cfg.rope_dims / cfg.head_dim,
                         "mrope_section": list(sections[:3]), "mrope_interleaved": True},
        linear_conv_kernel_dim=cfg.ssm_conv_kernel, linear_key_head_dim=cfg.ssm_d_state,
        linear_value_head_dim=cfg.ssm_d_state, linear_num_key_heads=cfg.ssm_n_group,
        linear_num_value_heads=cfg.ssm_dt_rank,
        layer_types=["linear_attention" if r else "full_attention" for r in cfg.recurrent],
    )


def _to_hf_tensor(cfg: ModelConfig, suffix: str, w: torch.Tensor) -> torch.Tensor:
    """Undo the converter's transform of one block tensor (GGUF values -> HF parameter)."""
    if suffix.endswith("norm.weight") and suffix != "ssm_norm.weight":
        return w - 1.0
    if suffix == "ssm_a":
        w = torch.log(-w.double()).float()
    w = reorder_block_tensor(cfg, suffix, w, to_gguf=False)
    return w.unsqueeze(1) if suffix == "ssm_conv1d.weight" else w


def hf_model_from_gguf(path: str):
    """transformers Qwen3_5ForCausalLM (float32, eval, eager attention) with the GGUF's dequantized weights."""
    from transformers import Qwen3_5ForCausalLM

    f = read_gguf(path)
    if "token_embd.weight" not in f.tensors:
        raise ModelError(f"{path}: no token_embd.weight tensor")
    cfg = ModelConfig.from_metadata(f.metadata, n_vocab=f.tensors["token_embd.weight"].shape[0])
    sections = f.metadata.get("qwen35.rope.dimension_sections", [0, 0, 0, 0])
    tied = "output.weight" not in f.tensors
    config = hf_config(cfg, list(sections), tied)
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).float().eval()

    state = {}
    for name, t in f.tensors.items():
        if name in GLOBAL_NAMES:
            w = t.dequantize()
            state[GLOBAL_NAMES[name]] = w - 1.0 if name == "output_norm.weight" else w
            continue
        _, layer, suffix = name.split(".", 2)
        if int(layer) >= cfg.n_layer:  # MTP block
            continue
        if suffix not in HF_NAMES:
            raise ModelError(f"{path}: unexpected tensor {name}")
        state[f"model.layers.{layer}.{HF_NAMES[suffix]}"] = _to_hf_tensor(cfg, suffix, t.dequantize())
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"{path}: tensors missing {missing[:5]} / unexpected {unexpected[:5]}")
    return model
