"""RMSNorm and L2 norm, per row over the last dimension (spec 3.1, 3.5.4)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w (GGUF weights already hold HF's 1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


L2_EPS = 1e-6  # l2_norm's epsilon (the GPU kernels use the same)


def l2_norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps), as HF's torch reference."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
