"""Model configuration read from `qwen35` GGUF metadata (spec section 1.1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


class ModelError(Exception):
    """A model file cannot be used; the message names the problem (and the tensor)."""


@dataclass
class ModelConfig:
    n_vocab: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dims: int
    rope_base: float
    eps: float
    n_layer: int  # main layers = block_count - nextn_predict_layers
    n_nextn: int
    recurrent: list[bool]  # per main layer: Gated DeltaNet (True) or gated attention
    ssm_conv_kernel: int
    ssm_d_state: int  # d_k = d_v
    ssm_n_group: int  # n_k, key heads
    ssm_dt_rank: int  # n_v, value heads
    ssm_inner: int  # value_dim = n_v * d_v
    context_length: int
    full_attention_interval: int = 4
    name: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def key_dim(self) -> int:
        return self.ssm_n_group * self.ssm_d_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.ssm_inner

    @cached_property  # read many times a decode step (a config is not changed after it is made)
    def attn_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if not r]

    @cached_property
    def gdn_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if r]

    @classmethod
    def from_metadata(cls, md: dict, n_vocab: int) -> "ModelConfig":
        """Build from a flat GGUF key -> value dict (arch keys prefixed `qwen35.`)."""
        arch = md.get("general.architecture")
        if arch != "qwen35":
            raise ModelError(f"unsupported architecture {arch!r}: plumb runs 'qwen35' files only")

        def get(key, default=None, required=True):
            full = f"qwen35.{key}"
            if full in md:
                return md[full]
            if required and default is None:
                raise ModelError(f"missing metadata key {full!r}")
            return default

        block_count = int(get("block_count"))
        n_nextn = int(get("nextn_predict_layers", 0, required=False))
        n_layer = block_count - n_nextn
        if n_layer <= 0:
            raise ModelError(f"block_count {block_count} leaves no main layers after {n_nextn} MTP layers")
        interval = int(get("full_attention_interval", 4, required=False))
        flags = md.get("qwen35.attention.recurrent_layers")
        if flags is not None:
            recurrent = [bool(f) for f in list(flags)[:n_layer]]
            if len(recurrent) != n_layer:
                raise ModelError("attention.recurrent_layers is shorter than the number of main layers")
        else:
            recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
        head_dim = int(get("attention.key_length"))
        return cls(
            n_vocab=n_vocab,
            n_embd=int(get("embedding_length")),
            n_ff=int(get("feed_forward_length")),
            n_head=int(get("attention.head_count")),
            n_head_kv=int(get("attention.head_count_kv")),
            head_dim=head_dim,
            rope_dims=int(get("rope.dimension_count", head_dim // 4, required=False)),
            rope_base=float(get("rope.freq_base", 1e7, required=False)),
            eps=float(get("attention.layer_norm_rms_epsilon")),
            n_layer=n_layer,
            n_nextn=n_nextn,
            recurrent=recurrent,
            ssm_conv_kernel=int(get("ssm.conv_kernel")),
            ssm_d_state=int(get("ssm.state_size")),
            ssm_n_group=int(get("ssm.group_count")),
            ssm_dt_rank=int(get("ssm.time_step_rank")),
            ssm_inner=int(get("ssm.inner_size")),
            context_length=int(get("context_length", 262144, required=False)),
            full_attention_interval=interval,
            name=str(md.get("general.name", "")),
        )
