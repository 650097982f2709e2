"""StopChecker: exact cuts at stop strings, however the text is split into deltas."""

from __future__ import annotations

import random

import pytest

from gearshift.worker.tokenizer import StopChecker


def run(checker: StopChecker, deltas: list[str]) -> tuple[str, str | None, list[str]]:
    """Feed deltas until a stop; return (all emitted text, matched stop, per-feed emissions)."""
    emitted: list[str] = []
    for delta in deltas:
        result = checker.feed(delta)
        emitted.append(result.text)
        if result.stopped:
            return "".join(emitted), result.stop_str, emitted
    emitted.append(checker.flush())
    return "".join(emitted), None, emitted


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_stop_string_spanning_several_deltas_is_cut_exactly() -> None:
    text, stop, emitted = run(StopChecker(["STOP"]), ["hello S", "T", "O", "P and more"])
    assert (text, stop) == ("hello ", "STOP")
    assert emitted == ["hello ", "", "", ""]


def test_held_back_text_is_released_when_the_stop_does_not_complete() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("go ST").text == "go "
    result = checker.feed("ORM")
    assert result.text == "STORM" and not result.stopped


def test_flush_returns_the_held_tail_when_generation_ends_otherwise() -> None:
    checker = StopChecker(["</answer>"])
    assert checker.feed("42 </ans").text == "42 "
    assert checker.flush() == "</ans"
    assert checker.flush() == ""


def test_earliest_stop_string_wins() -> None:
    text, stop, _ = run(StopChecker(["world", "lo"]), ["hello world"])
    assert (text, stop) == ("hel", "lo")
    # Split into characters: the same answer.
    text, stop, _ = run(StopChecker(["world", "lo"]), list("hello world"))
    assert (text, stop) == ("hel", "lo")


def test_overlapping_stops_resolve_by_first_completion_whatever_the_split() -> None:
    # "b" completes before "abc" does, so it wins whether "abc" comes at once or char by char.
    for deltas in (["xabc"], list("xabc"), ["xa", "bc"]):
        assert run(StopChecker(["abc", "b"]), deltas)[:2] == ("xa", "b")


def test_include_stop_str_in_output_keeps_the_stop_and_drops_the_rest() -> None:
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    text, stop, emitted = run(checker, ["hello S", "TO", "P tail"])
    assert (text, stop) == ("hello STOP", "STOP")
    assert emitted[0] == "hello S"  # nothing needs holding back when the stop goes out anyway


def test_after_a_stop_every_delta_is_dropped() -> None:
    checker = StopChecker(["\n\n"])
    assert checker.feed("a\n\nb").text == "a"
    later = checker.feed("more")
    assert later.text == "" and later.stopped and later.stop_str == "\n\n"
    assert checker.stopped


def test_no_stop_strings_pass_text_through() -> None:
    checker = StopChecker([])
    assert checker.feed("abc").text == "abc"
    assert checker.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_random_splits_cut_where_the_first_stop_string_completes(include: bool) -> None:
    rng = random.Random(0)
    stops = ["###", "<end>", "ab"]
    alphabet = "ab#<end> xy"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 30)))
        emitted, stop, _ = run(StopChecker(stops, include), random_split(text, rng))
        # Reference: the first position where any stop string ends, cut at its start (or end).
        ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if ends:
            end, start, first = min(ends, key=lambda e: (e[0], e[1]))
            assert (emitted, stop) == (text[: end if include else start], first)
        else:
            assert (emitted, stop) == (text, None)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])
