"""Sampler: greedy, seeded reproducibility across batches, penalties, logprobs, frequencies."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gearshift.worker.sampling import Sampler, SamplingParams, SamplingState
from gearshift.worker.sampling.penalties import apply_penalties

VOCAB = 1000


def seeded(params: SamplingParams, **kwargs: object) -> SamplingState:
    assert params.seed is not None
    generator = torch.Generator().manual_seed(params.seed)
    return SamplingState(params, generator, **kwargs)  # type: ignore[arg-type]


def test_greedy_rows_take_the_argmax_in_any_dtype() -> None:
    logits = torch.randn(6, VOCAB)
    states = [SamplingState(SamplingParams(temperature=0.0)) for _ in range(6)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler().sample(logits.to(dtype), states)
        assert out.token_ids == logits.to(dtype).argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 6


def test_sampling_never_modifies_the_callers_logits() -> None:
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, min_p=0.1)
    Sampler().sample(logits, [SamplingState(params, output_token_ids=[1, 2])] * 2)
    assert torch.equal(logits, before)


def test_greedy_and_sampled_rows_share_a_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=5.0)
    states = [SamplingState(greedy if i % 2 == 0 else hot) for i in range(8)]
    sampler = Sampler(torch.Generator().manual_seed(1))
    draws = [sampler.sample(logits, states).token_ids for _ in range(5)]
    argmax = logits.argmax(dim=-1).tolist()
    for tokens in draws:
        assert tokens[0::2] == argmax[0::2]
    # At temperature 5 over 1000 tokens the sampled rows vary and leave the argmax.
    assert len({tuple(d[1::2]) for d in draws}) > 1
    assert any(d[1::2] != argmax[1::2] for d in draws)


def test_same_seed_gives_the_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    steps = 12
    step_logits = torch.randn(steps, VOCAB) * 3
    tracked = [
        SamplingParams(temperature=0.8, top_k=20, seed=123),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.01, repetition_penalty=1.2, seed=7),
        SamplingParams(temperature=1.0, seed=99, presence_penalty=0.5),
    ]
    companions = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_p=0.5, top_k=3),
        SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.0),
        SamplingParams(temperature=2.0, min_p=0.2),
    ]

    def run(params: SamplingParams, mixed: bool) -> list[int]:
        rng = random.Random(params.seed)
        state_gen = torch.Generator().manual_seed(params.seed or 0)
        sampler = Sampler()
        prompt, output = [1, 2, 3], []
        for step in range(steps):
            me = SamplingState(params, state_gen, prompt, list(output))
            batch, rows = [me], [step_logits[step]]
            if mixed:
                for _ in range(rng.randint(1, 6)):
                    other = rng.choice(companions)
                    gen = torch.Generator().manual_seed(other.seed) if other.seed else None
                    batch.append(SamplingState(other, gen, [4], [5, 6]))
                    rows.append(torch.randn(VOCAB) * 3)
            order = list(range(len(batch)))
            rng.shuffle(order)
            out = sampler.sample(torch.stack([rows[i] for i in order]), [batch[i] for i in order])
            output.append(out.token_ids[order.index(0)])
        return output

    for params in tracked:
        alone = run(params, mixed=False)
        assert run(params, mixed=True) == alone
        assert run(params, mixed=False) == alone
    other_seed = SamplingParams(temperature=1.3, top_p=0.9, seed=8)
    assert run(other_seed, mixed=False) != run(tracked[1], mixed=False)


def test_penalties_match_the_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    apply_penalties(logits, [[0]], [[1, 3, 3]], [2.0], [0.5], [0.25])
    # token 0 (prompt, > 0): 2 / 2; token 1 (once in output): -1 * 2 - 0.25 - 0.5;
    # token 3 (twice in output): 3 / 2 - 0.25 * 2 - 0.5; tokens 2 and 4 unseen.
    assert logits.tolist() == [[1.0, -2.75, 0.5, 0.5, -2.0]]


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    apply_penalties(logits, [[0, 0, 1]], [[1]], [1.0], [1.0], [1.0])
    assert logits.tolist() == [[1.0, -1.0, 1.0]]


def test_greedy_picks_the_argmax_after_penalties() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5)
    plain = SamplingParams(temperature=0.0)
    states = [SamplingState(penalised, None, [0], [3, 3]), SamplingState(plain, None, [0], [3, 3])]
    assert Sampler().sample(logits, states).token_ids == [0, 3]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    eos = frozenset({2})

    def pick(output: list[int], p: SamplingParams = params) -> int:
        state = SamplingState(p, None, [], output, eos_token_ids=eos)
        return Sampler().sample(logits, [state]).token_ids[0]

    assert pick([]) == 4 and pick([5]) == 4
    assert pick([5, 5]) == 2
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    assert pick([], ignore) == 2


def test_logprobs_come_from_the_raw_logits_sorted_best_first() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=1.5, top_k=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    states = [SamplingState(p, None, [1], [2]) for p in params]
    out = Sampler().sample(logits, states)
    expected = logits.float().log_softmax(dim=-1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(expected[0, first.token_id].item(), abs=1e-6)
    assert [t for t, _ in first.top] == expected[0].topk(5).indices.tolist()
    values = [v for _, v in first.top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(expected[0].topk(5).values.tolist(), abs=1e-6)
    assert first.rank == int((expected[0] > expected[0, first.token_id]).sum()) + 1
    second = out.logprobs[1]
    assert second is not None and second.top == () and second.rank == 1
    assert out.logprobs[2] is None


def probabilities(*values: float) -> torch.Tensor:
    return torch.tensor([math.log(v) for v in values])


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), [0.3, 0.25, 0.2, 0.15, 0.07, 0.03]),
        # top-4 then top-p 0.8 on the renormalised four: .3/.9 + .25/.9 < .8 keeps three.
        (SamplingParams(top_k=4, top_p=0.8), [0.4, 1 / 3, 0.8 / 3, 0, 0, 0]),
        # min_p 0.5: tokens below 0.15 go.
        (SamplingParams(min_p=0.5), [0.3 / 0.9, 0.25 / 0.9, 0.2 / 0.9, 0.15 / 0.9, 0, 0]),
    ],
)
def test_empirical_frequencies_match_the_masked_distribution(
    params: SamplingParams, expected: list[float]
) -> None:
    draws = 20000
    logits = probabilities(0.3, 0.25, 0.2, 0.15, 0.07, 0.03).expand(draws, -1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    tokens = torch.tensor(sampler.sample(logits, [SamplingState(params)] * draws).token_ids)
    frequencies = torch.bincount(tokens, minlength=6).double() / draws
    # 4.5 standard deviations of a binomial proportion at p = 0.5 over 20000 draws.
    assert frequencies.tolist() == pytest.approx(expected, abs=0.016)


def test_seeded_row_samples_the_temperature_scaled_distribution() -> None:
    params = SamplingParams(temperature=2.0, seed=11)
    state = seeded(params)
    logits = probabilities(0.6, 0.3, 0.1).unsqueeze(0)
    sampler = Sampler()
    tokens = torch.tensor([sampler.sample(logits, [state]).token_ids[0] for _ in range(3000)])
    frequencies = torch.bincount(tokens, minlength=3).double() / 3000
    scaled = torch.tensor([0.6, 0.3, 0.1]).sqrt()
    assert frequencies.tolist() == pytest.approx((scaled / scaled.sum()).tolist(), abs=0.035)


def test_logits_and_states_must_agree() -> None:
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(torch.randn(2, 5), [SamplingState(SamplingParams())])
