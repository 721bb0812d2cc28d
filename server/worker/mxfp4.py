"""MXFP4 expert weights, as the hub's gpt-oss checkpoints store them, decoded to the model's
dtype at load (docs/engine.md, "gpt-oss").

The format (OCP Microscaling Formats spec, MXFP4): each block of 32 consecutive values along a
weight's input dimension shares one E8M0 scale, a bare 8-bit exponent with bias 127 (the block's
scale is ``2 ** (byte - 127)``); each value is FP4 E2M1, one sign bit, two exponent bits (bias 1)
and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. A checkpoint packs two
values a byte, the block's even-indexed value in the low nibble. gpt-oss names them
``<projection>_blocks`` (``uint8 [experts, out, in / 32, 16]``) and ``<projection>_scales``
(``uint8 [experts, out, in / 32]``) beside the unquantized ``<projection>_bias``; decoded, a
projection is ``[experts, out, in]``, transformers' stacked ``[experts, in, out]`` transposed.

Every value a block holds is exactly representable in bfloat16 and float32, so the decode is
exact (compared with transformers' own on the same tensors in tests/server/worker/test_gpt_oss_mxfp4.py).
It runs one expert at a time in float32, written into the output in the model's dtype: a layer's
decode never holds more than one expert in float32 beside it.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127  # E8M0: the scale is 2 ** (byte - 127)
_SUFFIXES = ("_blocks", "_scales")
# The expert projections decoded here; MXFP4 on any other tensor is refused (mxfp4_refusal).
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def e2m1_values() -> torch.Tensor:
    """The 16 FP4 E2M1 codes' values, by code: bit 3 the sign, bits 2-1 the exponent (bias 1;
    0 is subnormal: no implicit one), bit 0 the mantissa's one bit."""
    values = []
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        exponent, mantissa = (code >> 1) & 0b11, code & 1
        magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


_E2M1 = e2m1_values()
# Each byte's two values, low nibble first: one gather a byte instead of one a nibble (1.5x the
# decode's speed on a CPU, where it runs at load).
_BYTE_PAIRS = torch.stack([_E2M1[torch.arange(256) & 0x0F], _E2M1[torch.arange(256) >> 4]], dim=-1)


def is_mxfp4_tensor(name: str) -> bool:
    """A checkpoint tensor of packed MXFP4 values or their scales (kept as uint8 at load)."""
    return name.endswith(_SUFFIXES)


def decoded_numel(name: str, dtype: str, stored: int) -> int:
    """How many model values a checkpoint tensor of ``stored`` elements (safetensors ``dtype``)
    loads as: an MXFP4 blocks tensor two a byte, its scales none (folded into those values)."""
    if dtype != "U8" or not is_mxfp4_tensor(name):
        return stored
    return 2 * stored if name.endswith("_blocks") else 0


def mxfp4_refusal(names: list[str]) -> str | None:
    """Why these checkpoint tensors cannot load: MXFP4 on anything but a gpt-oss layer's stacked
    expert projections; None where every MXFP4 tensor is one of those."""
    others = [n for n in names if is_mxfp4_tensor(n)
              and not any(n.endswith(f".mlp.experts.{p}{s}") for p in EXPERT_PROJECTIONS for s in _SUFFIXES)]
    if not others:
        return None
    return (f"checkpoint tensors {others[:3]} are MXFP4 outside the experts: kvscale decodes MXFP4 only in "
            f"the mixture-of-experts projections ({', '.join(EXPERT_PROJECTIONS)}); dequantize the checkpoint first")


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` ``uint8 [..., groups, 16]`` and ``scales`` ``uint8 [..., groups]`` as
    ``dtype [..., groups * 32]``: each byte's low nibble first."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: blocks are "
                         f"[..., groups, {BLOCK // 2}] over scales [..., groups]")
    values = _BYTE_PAIRS.to(blocks.device)[blocks.int()].flatten(-2)  # [..., groups, 32]
    values *= block_scales(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def block_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes as float32 ``2 ** (byte - 127)``, built from the bits: float32's exponent has
    the same bias, so the byte is the exponent field (exact by construction, whatever the
    backend's ``exp2``); byte 0 is float32's subnormal 2 ** -127, byte 255 the spec's NaN."""
    exponent = scales.to(torch.int32)
    bits = torch.where(exponent == 0, torch.tensor(1 << 22, dtype=torch.int32), exponent << 23)
    bits = torch.where(exponent == 255, torch.tensor(0x7FC00000, dtype=torch.int32), bits)
    return bits.view(torch.float32)


def decode_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stacked projection ``[experts, out, in / 32, 16]`` (with its scales) as transformers
    holds it unquantized, ``dtype [experts, in, out]`` (a transposed view of ``[experts, out,
    in]``), decoded one expert at a time."""
    if blocks.dim() != 4:
        raise ValueError(f"MXFP4 expert blocks are [experts, out, in / {BLOCK}, {BLOCK // 2}], not "
                         f"{tuple(blocks.shape)}")
    experts, out, groups, _ = blocks.shape
    decoded = torch.empty(experts, out, groups * BLOCK, dtype=dtype, device=blocks.device)
    for e in range(experts):
        decoded[e] = decode(blocks[e], scales[e], dtype)
    return decoded.transpose(1, 2)
