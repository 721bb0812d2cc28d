"""Sampler on hand-made logits: every knob changes the distribution the way it should."""

from __future__ import annotations

import math

import torch

from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.sampler import Sampler, SamplingRow, make_generator

VOCAB = 8
EOS = 7


def sampler() -> Sampler:
    return Sampler({EOS}, lambda t: f"<{t}>", seed=0)


def row(params: SamplingParams, tokens=(1, 2), prompt_len=2, index=0) -> SamplingRow:
    return SamplingRow(params, list(tokens), prompt_len, make_generator(params.seed, index))


def logits_rows(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def draw_many(params: SamplingParams, logits: list[float], count: int = 400) -> list[int]:
    s = sampler()
    rows = [row(params) for _ in range(count)]
    tokens, _ = s(logits_rows(*([logits] * count)), rows)
    return tokens


def test_bfloat16_logits_sample_as_their_float32_values_do():
    """Greedy rows are argmaxed in the model's dtype (ties, common in bfloat16, to the first),
    rows that need a distribution on float32: the same tokens and logprobs either way."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 1000, generator=generator) * 4).round().bfloat16()  # many exact ties
    greedy = [row(SamplingParams(temperature=0)) for _ in range(64)]
    tokens, _ = sampler()(logits, greedy)
    assert tokens == sampler()(logits.float(), greedy)[0] == logits.float().argmax(dim=1).tolist()

    def mixed() -> list[SamplingRow]:  # fresh generators for each call
        return [row(SamplingParams(temperature=0, logprobs=2)), row(SamplingParams(temperature=0.7, seed=5)),
                row(SamplingParams(temperature=0, repetition_penalty=1.3), tokens=(5, 9))]

    assert sampler()(logits[:3], mixed()) == sampler()(logits[:3].float(), mixed())


def test_greedy_takes_argmax():
    tokens, logprobs = sampler()(logits_rows([0, 3, 1, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 0]),
                                 [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0))])
    assert tokens == [1, 0] and logprobs == [None, None]


def test_top_k_one_is_greedy_even_when_hot():
    assert set(draw_many(SamplingParams(temperature=5.0, top_k=1), [0, 1, 2, 9, 0, 0, 0, 0])) == {3}


def test_top_k_restricts_support():
    got = set(draw_many(SamplingParams(temperature=10.0, top_k=3), [5, 4, 3, 2, 1, 0, 0, 0]))
    assert got <= {0, 1, 2} and len(got) == 3


def test_top_p_keeps_smallest_set_reaching_mass():
    # probs ~ [0.5, 0.3, 0.2, tiny...]: top_p=0.7 keeps tokens 0 and 1 only.
    probs = [0.5, 0.3, 0.2 - 7e-6] + [1e-6] * 5
    logits = [math.log(p) for p in probs]
    got = set(draw_many(SamplingParams(temperature=1.0, top_p=0.7), logits))
    assert got == {0, 1}


def test_min_p_drops_unlikely_tokens():
    probs = [0.6, 0.3, 0.05, 0.05 - 5e-6] + [1e-6] * 4
    logits = [math.log(p) for p in probs]
    got = set(draw_many(SamplingParams(temperature=1.0, min_p=0.2), logits))
    assert got == {0, 1}


def test_sampling_follows_distribution():
    probs = [0.7, 0.3] + [0.0] * 6
    logits = [math.log(p) if p else -1e9 for p in probs]
    tokens = draw_many(SamplingParams(temperature=1.0, seed=None), logits, count=2000)
    share = tokens.count(0) / len(tokens)
    assert 0.65 < share < 0.75 and set(tokens) == {0, 1}


def test_seeded_rows_are_batch_independent():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [sampler()(logits[3:4], [row(params)])[0][0] for _ in range(1)]
    # Same seeded request among unseeded neighbours, at another position in the batch.
    s = sampler()
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(6)]
    rows[5] = row(params)
    batch_logits = logits.clone()
    batch_logits[5] = logits[3]
    in_batch = s(batch_logits, rows)[0][5]
    assert alone[0] == in_batch
    # And a sequence of draws from one generator is reproducible.
    seq_a = [sampler()(logits[3:4], [r])[0][0] for r in [row(params)] for _ in range(5)]
    r = row(params)
    seq_b = [sampler()(logits[3:4], [r])[0][0] for _ in range(5)]
    r2 = row(params)
    seq_c = [sampler()(logits[3:4], [r2])[0][0] for _ in range(5)]
    assert seq_b == seq_c and len(seq_a) == 5


def test_n_samples_of_a_seeded_request_differ():
    assert make_generator(1, 0).initial_seed() != make_generator(1, 1).initial_seed()
    assert make_generator(None, 0) is None


def test_repetition_penalty_discourages_seen_tokens():
    logits = logits_rows([2.0, 2.1, 0, 0, 0, 0, 0, 0])
    tokens, _ = sampler()(logits, [row(SamplingParams(temperature=0, repetition_penalty=1.5), tokens=[1], prompt_len=1)])
    assert tokens == [0]


def test_presence_and_frequency_penalties_use_outputs_only():
    logits = logits_rows([1.0, 1.2, 0, 0, 0, 0, 0, 0])
    # Token 1 was generated twice: frequency 0.2 * 2 = 0.4 > 0.2 gap.
    p = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert sampler()(logits, [row(p, tokens=[5, 1, 1], prompt_len=1)])[0] == [0]
    # In the prompt only: no penalty.
    assert sampler()(logits, [row(p, tokens=[1, 1, 5], prompt_len=3)])[0] == [1]
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sampler()(logits, [row(p, tokens=[5, 1], prompt_len=1)])[0] == [0]


def test_min_tokens_hides_eos_and_stop_ids():
    logits = logits_rows([0, 0, 0, 0, 0, 1.0, 2.0, 9.0])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6])
    assert sampler()(logits, [row(p, tokens=[1, 2], prompt_len=2)])[0] == [5]
    # Reached min_tokens: EOS allowed again.
    assert sampler()(logits, [row(p, tokens=[1, 2, 3, 4], prompt_len=2)])[0] == [EOS]
    # ignore_eos: EOS is not an ending token, so min_tokens does not hide it.
    p = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler()(logits, [row(p, tokens=[1], prompt_len=1)])[0] == [EOS]


def test_logprobs_chosen_and_top_n():
    raw = [1.0, 3.0, 2.0, 0, 0, 0, 0, 0]
    tokens, logprobs = sampler()(logits_rows(raw), [row(SamplingParams(temperature=0, logprobs=2))])
    expected = torch.log_softmax(torch.tensor(raw), dim=0)
    position = logprobs[0]
    assert tokens == [1] and set(position) == {1, 2}
    assert position[1].rank == 1 and position[2].rank == 2
    assert math.isclose(position[1].logprob, float(expected[1]), rel_tol=1e-6)
    assert position[2].decoded_token == "<2>"
    # The chosen token is always reported, with its true rank, even outside the top-N.
    _, logprobs = sampler()(logits_rows(raw), [row(SamplingParams(temperature=0, logprobs=0))])
    assert list(logprobs[0]) == [1]
    p = SamplingParams(temperature=0, logprobs=1, repetition_penalty=100.0)
    tokens, logprobs = sampler()(logits_rows(raw), [row(p, tokens=[1], prompt_len=1)])
    assert tokens == [2] and logprobs[0][2].rank == 2 and logprobs[0][1].rank == 1


def test_greedy_tokens_is_argmax_ties_included() -> None:
    from kvscale.server.worker.sampler import greedy_tokens

    logits = torch.zeros(3, 10)
    logits[0, [2, 5]] = 1.0  # a tie: the first index wins, as with argmax
    logits[1, 7] = 3.0
    logits[2, :] = -1.0  # all equal
    assert greedy_tokens(logits).tolist() == [2, 7, 0]
    rows = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy_tokens(rows), rows.argmax(dim=1))


def test_logit_bias_is_one_scatter_built_once_per_request(monkeypatch):
    """Each row's bias lands on its own row; the tensors of a request's bias are made once, not
    per entry per step (docs/server.md "Request limits")."""
    from kvscale.server.worker import sampler as sampler_module

    built = []
    real = sampler_module.bias_tensors
    monkeypatch.setattr(sampler_module, "bias_tensors", lambda bias, width: built.append(1) or real(bias, width))
    shared = SamplingParams(temperature=0, logit_bias={3: 100.0, 5: -100.0})
    other = shared.with_max_tokens(4)  # another prompt of the same request
    alone = SamplingParams(temperature=0, logit_bias={6: 100.0})
    s = sampler()
    for _ in range(5):
        tokens, _ = s(logits_rows([0.0] * VOCAB, [0.0] * VOCAB, [0.0] * VOCAB, [9.0] + [0.0] * 7),
                      [row(shared), row(other), row(alone), row(SamplingParams(temperature=0))])
        assert tokens == [3, 3, 6, 0]
    assert len(built) == 3  # once per params object, whatever the number of steps


def test_stop_token_ids_are_a_set_following_the_field():
    params = SamplingParams(stop_token_ids=[4, 5, 4])
    assert params.stop_token_set == frozenset({4, 5})
    assert params.stop_token_set is params.stop_token_set  # built once
    params.stop_token_ids = [6]  # replaced (as the core's wire decoder does): the set follows
    assert params.stop_token_set == frozenset({6})
