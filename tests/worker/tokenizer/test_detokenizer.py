"""IncrementalDetokenizer: deltas add up to the full decode and never hold a partial character."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from gearshift.worker.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ça va? Très bien, merci. Größe, straße, æøå, ñandú.",
    "中文文本测试，包括标点符号。日本語のひらがなとカタカナ。한국어 텍스트.",
    "Emoji: 🎉🚀👍🏽 family 👩‍👩‍👧‍👦 flags 🇯🇵🇫🇷 keycap 1️⃣",
    "Mixed: naïve 東京 🗼 – “quotes” … ∑ x² ≤ ∞",
    "code:\n\tfor i in range(10):\n\t\tprint(f'{i:>3}')\n",
    "   multiple   spaces\n\n\nand blank lines   ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters and 🂡 playing cards",
]
SEPARATORS = ["", "<|im_end|>", "<|im_start|>assistant\n", "<|endoftext|>"]


def stream(
    tokenizer: Tokenizer,
    output_ids: Sequence[int],
    prompt_ids: Sequence[int] = (),
    skip_special_tokens: bool = True,
    chunk_sizes: Sequence[int] | None = None,
) -> list[str]:
    """Feed `output_ids` in chunks (one token each by default); return every delta, flush last."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, position, sizes = [], 0, iter(chunk_sizes or [])
    while position < len(output_ids):
        size = next(sizes, 1)
        deltas.append(detok.step(output_ids[position : position + size]))
        position += size
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streaming_text_equals_full_decode_and_never_emits_a_partial_char(
    smollm_tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    prompt = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "Say something"}])
    for _ in range(40):
        pieces = rng.sample(TEXTS, 3)
        text = rng.choice(SEPARATORS).join(pieces)
        ids = smollm_tokenizer.encode(text, add_special_tokens=False)
        deltas = stream(smollm_tokenizer, ids, prompt, skip_special_tokens)
        expected = smollm_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected
        assert "\ufffd" not in expected
        assert all("\ufffd" not in d for d in deltas)
        assert deltas[-1] == ""  # valid text leaves nothing held back for flush


def test_multi_token_steps_give_the_same_text(smollm_tokenizer: Tokenizer) -> None:
    rng = random.Random(1)
    for text in TEXTS:
        ids = smollm_tokenizer.encode(text)
        chunks = [rng.randint(1, 4) for _ in ids]
        assert "".join(stream(smollm_tokenizer, ids, chunk_sizes=chunks)) == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_stream_to_the_full_decode(
    smollm_tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    # Random ids include lone UTF-8 lead/continuation bytes and special tokens anywhere.
    rng = random.Random(2)
    prompt = smollm_tokenizer.encode("Prompt text: ")
    for _ in range(300):
        ids = [rng.randrange(smollm_tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        ids += [rng.randrange(17) for _ in range(rng.randint(0, 2))]  # special tokens
        rng.shuffle(ids)
        deltas = stream(smollm_tokenizer, ids, prompt, skip_special_tokens)
        assert "".join(deltas) == smollm_tokenizer.decode(ids, skip_special_tokens)


def test_character_split_by_a_skipped_special_token_is_emitted_once_complete(
    smollm_tokenizer: Tokenizer,
) -> None:
    ids = smollm_tokenizer.encode("界", add_special_tokens=False)
    assert len(ids) >= 2, "the character should span several byte-level tokens"
    split = [*ids[:1], 2, *ids[1:]]  # <|im_end|> between the bytes of one character
    deltas = stream(smollm_tokenizer, split, skip_special_tokens=True)
    assert deltas[:-1] == [""] * (len(split) - 1) + ["界"]
    assert "".join(deltas) == smollm_tokenizer.decode(split) == "界"


def test_window_stays_small_over_a_long_generation(smollm_tokenizer: Tokenizer) -> None:
    decoded_lengths: list[int] = []

    class Spy:
        all_special_ids = smollm_tokenizer.all_special_ids

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            decoded_lengths.append(len(ids))
            return smollm_tokenizer.decode(ids, skip_special_tokens)

    ids = smollm_tokenizer.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(Spy(), [], True)  # type: ignore[arg-type]
    text = "".join(detok.step([i]) for i in ids)
    assert text == smollm_tokenizer.decode(ids)
    assert max(decoded_lengths) <= 8


def test_sentencepiece_leading_spaces_follow_the_prompt(sentencepiece_tokenizer: Tokenizer) -> None:
    tok = sentencepiece_tokenizer
    prompt = tok.encode("the cat")
    output = tok.encode("hello world, héllo 世!", add_special_tokens=False)
    deltas = stream(tok, output, prompt)
    # The first "▁hello" continues the prompt, so its space is kept, as decode(prompt + output).
    full = tok.decode(prompt + output)
    assert "".join(deltas) == full[len(tok.decode(prompt)) :] == " hello world, héllo 世!"
    assert all("\ufffd" not in d for d in deltas)
    # Without a prompt the stream starts the text, and the leading space goes as decode drops it.
    assert "".join(stream(tok, output)) == tok.decode(output) == "hello world, héllo 世!"


def test_sentencepiece_space_survives_skipped_special_tokens(
    sentencepiece_tokenizer: Tokenizer,
) -> None:
    tok = sentencepiece_tokenizer
    output = [*tok.encode("hello", add_special_tokens=False), 2, 2, 2, 2, 2, 2]
    output += tok.encode("world", add_special_tokens=False)
    assert "".join(stream(tok, output, tok.encode("the cat"))) == " hello world"
    # A prompt ending in more skipped specials than the context window still gives the space.
    prompt = tok.encode("the cat") + [2] * 8
    assert "".join(stream(tok, output, prompt)) == " hello world"
    assert "".join(stream(tok, output, [1] * 8)) == tok.decode(output) == "hello world"
