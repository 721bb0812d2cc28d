"""Rotary position embeddings as transformers computes them: the inverse frequencies and cos/sin
scale of any RoPE type it knows, and the rotation itself (a whole head, or its first
``partial_rotary_factor`` of dimensions, the rest passed through)."""

from __future__ import annotations

from typing import Any

import torch

from kvscale.server.worker.model_config import ModelConfig


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE dict (``rope_parameters``, or the older ``rope_scaling``) with the
    fields transformers' ``standardize_rope_params`` moves into it from the config's top level."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    # transformers' order: the dict's own theta, then the config's (a family's default among them).
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    return params


def rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def rope_inv_freq(config: Any, head_dim: int, params: dict[str, Any] | None = None,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, for any RoPE type transformers knows.

    ``params``: the RoPE dict where a family keeps one per kind of layer (Gemma 3's
    ``layer_type``); by default the config's own."""
    if params is None:
        params = rope_parameters(config)
    if rope_type(params) == "default":
        base = float(params.get("rope_theta", 10000.0))
        dims = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if isinstance(config, ModelConfig):  # transformers' function reads transformers' own config
        config = config.transformers_config()
    # Read again from transformers' config: it renames legacy types (Phi-3's "su" is "longrope").
    theirs = config.rope_parameters
    if layer_type is not None:
        theirs = theirs[layer_type]
    extra = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type(theirs)](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


def cos_sin_table(inv_freq: torch.Tensor, scaling: float, head_dim: int, max_len: int,
                  like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_len, head_dim]`` for every position, in ``like``'s dtype and device; with
    partial rotary the tail is cos 1, sin 0 (those dimensions pass through)."""
    positions = torch.arange(max_len, dtype=torch.float32, device="cpu")
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(device=like.device, dtype=like.dtype)
    sin = (emb.sin() * scaling).to(device=like.device, dtype=like.dtype)
    rest = head_dim - emb.shape[-1]
    if rest:
        cos = torch.cat((cos, cos.new_ones(max_len, rest)), dim=-1)
        sin = torch.cat((sin, sin.new_zeros(max_len, rest)), dim=-1)
    return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """transformers' rotation of the first ``rotary_dim`` dimensions of each head (all of them
    without partial rotary), rotate-half within those only."""
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :rotary_dim]
    rotated = rot * cos[..., :rotary_dim] + rotate_half(rot) * sin[..., :rotary_dim]
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
