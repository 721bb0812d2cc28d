"""bench.gpu_engine's token checks: the engine's greedy tokens against transformers', and against
the same engine replaying decode graphs or stepping with async scheduling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import GREEDY_PROMPTS


def greedy_equality(path: Path, dtype: str, device: Any, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    # The repeat shares the third prompt's first two blocks (32 tokens): a prefix-cache hit.
    repeat = prompts[2][:32] + prompts[0]
    # Both sides stop at the end-of-sequence token: with ignore_eos the engine may emit it and go
    # on (vLLM's meaning), while transformers' min_new_tokens forbids it, so they would differ there.
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_seqs=8,
              max_num_batched_tokens=64, num_gpu_blocks_override=256)
    ours = [list(r.outputs[0].token_ids) for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits
    ours.append(list(llm.generate([{"prompt_token_ids": repeat}], params)[0].outputs[0].token_ids))
    hits = llm.llm_engine.get_stats().prefix_cache_hits - hits_before
    del llm
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
    rows = []
    with torch.inference_mode():
        for i, prompt in enumerate([*prompts, repeat]):
            ids = torch.tensor([prompt], device=device)
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            first_difference = next((j for j, (a, b) in enumerate(zip(ours[i], ref, strict=False)) if a != b),
                                    None if len(ours[i]) == len(ref) else min(len(ours[i]), len(ref)))
            rows.append({"prompt": i, "equal": ours[i] == ref, "first_difference": first_difference})
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"dtype": dtype, "new_tokens": new_tokens, "prefix_cache_hits_on_repeat": hits,
            "equal": sum(r["equal"] for r in rows), "prompts": len(rows), "rows": rows}


def graphs_vs_eager(path: Path, dtype: str, device: Any, new_tokens: int) -> dict:
    """Greedy tokens of the engine replaying decode graphs against the same engine eager, on
    batches that pad (5 prompts: the graph of 8) and that do not."""
    from transformers import AutoTokenizer

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in GREEDY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_seqs=16, max_num_batched_tokens=256,
                  num_gpu_blocks_override=256, enforce_eager=eager)
        tokens[eager] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]
        tokens[eager] += [list(r.outputs[0].token_ids) for r in llm.generate(prompts[:1], params)]
        graphs = llm.llm_engine.runner.decode_graphs
        if not eager and device.type == "cuda":
            assert graphs is not None and graphs.sizes[-1] == 16, "no decode graphs were captured"
        del llm
    rows = [{"equal": a == b, "first_difference": next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)}
            for a, b in zip(tokens[True], tokens[False], strict=True)]
    return {"dtype": dtype, "equal": sum(r["equal"] for r in rows), "sequences": len(rows), "rows": rows}


def async_vs_sync(path: Path, dtype: str, device: Any, new_tokens: int) -> dict:
    """Greedy tokens with async scheduling against the same engine stepping synchronously, decode
    graphs on, with every way a sequence ends (end token, stop string, max_tokens)."""
    from transformers import AutoTokenizer

    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in GREEDY_PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=max(new_tokens - 3 * i, 2), ignore_eos=i % 2 == 0,
                             stop=[".", "\n\n"] if i == 1 else [])
              for i in range(len(prompts))]
    tokens = {}
    for overlapped in (False, True):
        llm = LLM(model=str(path), dtype=dtype, device=str(device), max_num_seqs=16, max_num_batched_tokens=256,
                  num_gpu_blocks_override=256, async_scheduling=overlapped)
        tokens[overlapped] = [(list(r.outputs[0].token_ids), r.outputs[0].finish_reason)
                              for r in llm.generate(prompts, params)]
        del llm
    rows = [a == b for a, b in zip(tokens[False], tokens[True], strict=True)]
    return {"dtype": dtype, "equal": sum(rows), "sequences": len(rows),
            "finish_reasons": [reason for _, reason in tokens[True]]}
