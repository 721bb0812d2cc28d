"""A GGUF file as the model (`kvscale serve --model FILE.gguf`, `LLM(model=FILE.gguf)`): converted
once into $KVSCALE_CACHE by transformers' GGUF reader, then loaded as any checkpoint. A tiny
random-weight Llama GGUF is written here with gguf's own writer and the bundled GGUF's tokenizer;
transformers loading the same file is the reference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvscale.model_files import (
    gguf_target,
    load_tokenizer,
    resolve_model_path,
    resolve_tokenizer_path,
)

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def write_tiny_llama_gguf(out: Path) -> None:
    """Float32 tensors in llama.cpp's names; the bundled GGUF's tokenizer metadata."""
    from gguf import GGUFReader, GGUFWriter

    from kvscale.model_files import bundled_gguf_path

    bundled = GGUFReader(str(bundled_gguf_path()))
    vocab = len(bundled.fields["tokenizer.ggml.tokens"].contents())
    writer = GGUFWriter(str(out), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    for key in TOKENIZER_KEYS:
        field = bundled.fields[key]
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    gen = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        values = gen.standard_normal(shape) * 0.2 if len(shape) > 1 else 1 + 0.1 * gen.standard_normal(shape)
        writer.add_tensor(name, values.astype(np.float32))

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", vocab, HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    tensor("output.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: a conversion is made once (seconds: the GGUF's tokenizer)."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSCALE_CACHE", str(path))
        yield path


def test_a_gguf_file_serves_as_transformers_reads_it(tiny_gguf, cache, run_to_completion) -> None:
    from transformers import AutoModelForCausalLM

    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.sampling_params import SamplingParams

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                     dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", device="cpu", num_gpu_blocks_override=32,
                                    block_size=8))
    tokenizer = load_tokenizer(resolve_model_path(str(tiny_gguf)))
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outputs = run_to_completion(engine)
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            assert outputs[str(i)].outputs[0].token_ids == expected, i
    assert resolve_model_path(str(tiny_gguf)).parent == cache / "models"


def test_a_gguf_file_converts_once_and_again_when_replaced(tiny_gguf, cache) -> None:
    first = resolve_model_path(str(tiny_gguf))
    weights = first / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert resolve_model_path(str(tiny_gguf)) == first and weights.stat().st_mtime_ns == written
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the file replaced in place
    try:
        assert gguf_target(tiny_gguf) != first and not gguf_target(tiny_gguf).exists()
    finally:
        os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_router_takes_the_tokenizer_alone_from_a_gguf_file(tmp_path, tiny_gguf, cache) -> None:
    full = resolve_model_path(str(tiny_gguf))
    assert resolve_tokenizer_path(str(tiny_gguf)) == full  # the conversion, where it is made
    moved = full.rename(tmp_path / "full")  # as on a router's machine, where no engine converted it
    try:
        tokenizer_dir = resolve_tokenizer_path(str(tiny_gguf))
        assert not (tokenizer_dir / "model.safetensors").exists()  # the tokenizer alone
        text = "Hello, world! 1234"
        assert load_tokenizer(tokenizer_dir).encode(text) == load_tokenizer(moved).encode(text)
    finally:
        moved.rename(full)


def test_a_missing_model_names_both_forms(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"\.gguf file"):
        resolve_model_path(str(tmp_path / "absent.gguf"))
