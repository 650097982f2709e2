"""min-p / top-k / top-p masks on hand-built distributions."""

from __future__ import annotations

import math

import torch

from gearshift.worker.sampling import apply_min_p, apply_top_k, apply_top_k_top_p, apply_top_p


def logits_of(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > float("-inf")).flatten().tolist() for row in masked]


def test_top_k_keeps_the_k_largest_per_row() -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0, 3.0, 2.0], [5.0, 1.0, 2.0, 3.0, 4.0]])
    masked = apply_top_k(logits.clone(), torch.tensor([2, 3]))
    assert kept(masked) == [[1, 3], [0, 3, 4]]
    assert torch.equal(masked[0, [1, 3]], logits[0, [1, 3]])


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    masked = apply_top_k(torch.tensor([[1.0, 0.0, 1.0, 1.0]]), torch.tensor([2]))
    assert kept(masked) == [[0, 2, 3]]


def test_top_k_off_values_leave_rows_untouched() -> None:
    logits = torch.randn(4, 7)
    masked = apply_top_k(logits.clone(), torch.tensor([-1, 0, 7, 100]))
    assert torch.equal(masked, logits)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Positions shuffled so the scatter back from sorted order is exercised.
    logits = logits_of(0.15, 0.5, 0.05, 0.3)
    cases = {0.7: [1, 3], 0.79: [1, 3], 0.81: [0, 1, 3], 0.3: [1], 0.01: [1], 0.999: [0, 1, 2, 3]}
    for p, expected in cases.items():
        assert kept(apply_top_p(logits.clone(), torch.tensor([p]))) == [expected], p


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.randn(3, 50)
    masked = apply_top_p(logits.clone(), torch.tensor([1e-6, 1e-6, 1e-6]))
    assert kept(masked) == [[int(i)] for i in logits.argmax(dim=-1)]


def test_top_p_of_one_is_bit_exact_no_op() -> None:
    logits = torch.randn(2, 1000) * 10
    both = torch.tensor([1.0, 0.5])
    masked = apply_top_p(logits.clone(), both)
    assert torch.equal(masked[0], logits[0])
    assert (masked[1] == float("-inf")).any()


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    logits = logits_of(0.4, 0.3, 0.2, 0.1)
    # Alone, p = 0.5 needs two tokens (0.4 < 0.5); after top-2 the first holds 4/7 > 0.5.
    assert kept(apply_top_p(logits.clone(), torch.tensor([0.5]))) == [[0, 1]]
    both = apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([0.5]))
    assert kept(both) == [[0]]


def test_top_k_mask_is_the_same_on_the_sorting_path() -> None:
    # A top-k-only row must not change when another row of the batch forces the sort.
    logits = torch.randn(2, 300)
    logits[0, 10] = logits[0, 11] = logits[0].max() + 1  # a tie at the top
    top_k = torch.tensor([5, -1])
    alone = apply_top_k(logits.clone(), top_k)
    sorted_path = apply_top_k_top_p(logits.clone(), top_k, torch.tensor([1.0, 0.5]))
    assert torch.equal(alone[0], sorted_path[0])


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    logits = logits_of(0.15, 0.5, 0.05, 0.3)
    assert kept(apply_min_p(logits.clone(), torch.tensor([0.2]))) == [[0, 1, 3]]
    assert kept(apply_min_p(logits.clone(), torch.tensor([1.0]))) == [[1]]
    assert torch.equal(apply_min_p(logits.clone(), torch.tensor([0.0])), logits)
