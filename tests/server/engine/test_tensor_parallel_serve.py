"""`kvscale serve --tensor-parallel-size 2`: a rank killed under a streaming request fails that
request with an error and /health with the rank's name, never a hang."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from api_helpers import ServeProcess  # noqa: E402
from tiny_checkpoints import TOKENIZER_FILES, copy_tokenizer, write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny_llama(tmp_path):
    """A random 2-layer Llama with the bundled tokenizer; its vocabulary is the tokenizer's."""
    from kvscale.model_files import resolve_model_path

    copy_tokenizer(resolve_model_path(None), tmp_path, (*TOKENIZER_FILES, "chat_template.jinja"))
    write_tiny_llama(tmp_path, vocab=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     max_position_embeddings=512, norm_jitter=None)
    return tmp_path


def test_a_killed_rank_fails_the_stream_in_flight_and_health(tiny_llama) -> None:
    server = ServeProcess("--model", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
                          "--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                          "--tensor-parallel-size", "2", env={"OMP_NUM_THREADS": "1"}, log_name="tp-killed")
    try:
        found = re.search(r"tensor parallel over 2 ranks \(pids (\d+),(\d+)", server.log())
        assert found, server.log()
        rank_1 = int(found.group(2))
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices[0].text is not None
        os.kill(rank_1, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503
        assert f"rank 1 (pid {rank_1}, exit code -9)" in health.json()["error"]["message"], health.json()
    finally:
        server.stop()
