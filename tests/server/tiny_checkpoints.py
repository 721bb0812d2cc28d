"""Tiny random-weight checkpoints in the hub's tensor names, written directly with safetensors (no
transformers import: most of a small test's time on a busy machine otherwise)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def copy_tokenizer(bundled: Path, path: Path, names: tuple[str, ...] = TOKENIZER_FILES) -> None:
    for name in names:
        shutil.copy(bundled / name, path / name)


def decoder_layer_shapes(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int,
                         inter: int | None) -> dict[str, tuple[int, ...]]:
    """One Llama-style layer's attention, its dense MLP (none where ``inter`` is None: a MoE
    layer's experts come from the caller) and its two norms, in the hub's order."""
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
    }
    if inter is not None:
        shapes.update({prefix + "mlp.gate_proj.weight": (inter, hidden),
                       prefix + "mlp.up_proj.weight": (inter, hidden),
                       prefix + "mlp.down_proj.weight": (hidden, inter)})
    shapes.update({prefix + "input_layernorm.weight": (hidden,),
                   prefix + "post_attention_layernorm.weight": (hidden,)})
    return shapes


def save_random_weights(path: Path, shapes: dict[str, tuple[int, ...]], std: float,
                        norm_jitter: float | None) -> None:
    """Matrices of N(0, std); norm weights 1 + N(0, norm_jitter), or exactly 1 where None."""
    gen = torch.Generator().manual_seed(0)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) > 1:
            return std * torch.randn(shape, generator=gen)
        if norm_jitter is None:
            return torch.ones(shape)
        return 1.0 + norm_jitter * torch.randn(shape, generator=gen)

    from safetensors.torch import save_file

    save_file({name: tensor(shape) for name, shape in shapes.items()}, str(path / "model.safetensors"))


def write_tiny_llama(path: Path, *, vocab: int, tie_word_embeddings: bool, rms_norm_eps: float,
                     max_position_embeddings: int, norm_jitter: float | None) -> None:
    """A 2-layer Llama with 6 query heads and 2 KV heads (3 ranks must replicate KV heads)."""
    hidden, inter, heads, kv_heads, head_dim = 96, 192, 6, 2, 16
    config: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "tie_word_embeddings": tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    shapes["model.norm.weight"] = (hidden,)
    for i in range(2):
        shapes.update(decoder_layer_shapes(f"model.layers.{i}.", hidden, heads, kv_heads, head_dim, inter))
    save_random_weights(path, shapes, 0.08, norm_jitter)


def write_tiny_scheduling_llama(path: Path, bundled: Path, vocab: int = 500) -> Path:
    """The 2-layer Llama (float32-friendly norms, untied head) the scheduling tests run, with the
    bundled tokenizer: priority and step-interrupt tests compare its greedy tokens."""
    copy_tokenizer(bundled, path)
    write_tiny_llama(path, vocab=vocab, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     max_position_embeddings=256, norm_jitter=0.1)
    return path


def write_tiny_served_llama(path: Path) -> Path:
    """A random 2-layer Llama with the bundled tokenizer and chat template, its vocabulary the
    tokenizer's, so `kvscale serve` runs it as it runs the bundled model."""
    from kvscale.model_files import resolve_model_path

    copy_tokenizer(resolve_model_path(None), path, (*TOKENIZER_FILES, "chat_template.jinja"))
    write_tiny_llama(path, vocab=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     max_position_embeddings=512, norm_jitter=None)
    return path


def tiny_window_gemma3(vocab: int, window: int) -> Any:
    """A random 3-layer Gemma 3 in transformers (local, global, local layers; ``window`` tokens),
    small weights under random norms (each scales by 1 + weight, and fresh weights are zero), so
    greedy decoding wanders over many tokens rather than repeating one."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, head_dim=16, query_pre_attn_scalar=24, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_local_base_freq=100.0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 1.0)
    return model


def write_tiny_tp_llama(bundled: Path, path: Path, vocab: int) -> Path:
    """The tensor-parallel tests' Llama: ``write_tiny_llama``'s 6 query and 2 KV heads with random
    norms, a ``vocab``-row vocabulary, and the bundled tokenizer (``bundled``) beside it."""
    copy_tokenizer(bundled, path)
    write_tiny_llama(path, vocab=vocab, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     max_position_embeddings=256, norm_jitter=0.1)
    return path
