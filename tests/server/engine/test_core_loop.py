"""core_loop.add_all: one batch (one HTTP request's prompts) is one admission group, of its
tenant."""

from __future__ import annotations

from kvscale.server.engine.core_loop import add_all
from kvscale.server.sampling_params import SamplingParams


class RecordingEngine:
    def __init__(self) -> None:
        self.groups: dict[str, tuple[str, str]] = {}

    def add_request(self, request_id, prompt, params, *, cache_salt=None, group="", tenant="", lora_name=None):
        self.groups[request_id] = (group, tenant)

    def abort_request(self, request_id):
        self.groups.pop(request_id)


def test_a_batchs_prompts_share_one_group_and_a_single_prompt_has_its_own():
    engine = RecordingEngine()
    params = SamplingParams(max_tokens=1)
    assert add_all(engine, [("r-0", [1], params, None), ("r-1", [2], params, None)], "team-a") is None
    assert add_all(engine, [("s", [3], params, None)]) is None
    assert engine.groups == {"r-0": ("r-0", "team-a"), "r-1": ("r-0", "team-a"), "s": ("", "")}
