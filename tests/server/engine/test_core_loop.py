"""core_loop.add_all: one batch (one HTTP request's prompts) is one admission group, of its
tenant and its priority."""

from __future__ import annotations

from kvscale.server.engine.core_loop import add_all
from kvscale.server.sampling_params import SamplingParams


class RecordingEngine:
    def __init__(self) -> None:
        self.groups: dict[str, tuple[str, str]] = {}
        self.priorities: dict[str, int] = {}

    def add_request(self, request_id, prompt, params, *, cache_salt=None, group="", tenant="", lora_name=None,
                    priority=0):
        self.groups[request_id] = (group, tenant)
        self.priorities[request_id] = priority

    def abort_request(self, request_id):
        self.groups.pop(request_id)


def test_a_batchs_prompts_share_one_group_and_a_single_prompt_has_its_own():
    engine = RecordingEngine()
    params = SamplingParams(max_tokens=1)
    assert add_all(engine, [("r-0", [1], params, None), ("r-1", [2], params, None)], "team-a") is None
    assert add_all(engine, [("s", [3], params, None)]) is None
    assert add_all(engine, [("u", [4], params, None)], priority=-2) is None
    assert engine.groups == {"r-0": ("r-0", "team-a"), "r-1": ("r-0", "team-a"), "s": ("", ""), "u": ("", "")}
    assert engine.priorities == {"r-0": 0, "r-1": 0, "s": 0, "u": -2}
