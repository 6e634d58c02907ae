"""N-gram drafts against a brute-force search, on sequences that grow as they would."""

from __future__ import annotations

import random

import pytest

from hybridkv.engine.spec_decode.ngram import NgramProposer


def brute_force(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The longest suffix (high..low) found earlier; latest occurrence; copy, looping."""
    length = len(tokens)
    for n in range(min(high, length - 1), low - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # latest first; end < length
            if tokens[end - n : end] == suffix:
                out: list[int] = []
                while len(out) < k:
                    out.append((tokens + out)[end + len(out)])
                return out
    return []


@pytest.mark.parametrize(("low", "high", "k"), [(1, 1, 3), (2, 4, 4), (3, 5, 8), (1, 3, 1)])
def test_matches_brute_force_while_the_sequence_grows(low: int, high: int, k: int) -> None:
    rng = random.Random(low * 100 + high * 10 + k)
    proposer = NgramProposer(low, high, k)
    for trial in range(20):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        output: list[int] = []
        seq_id = f"s{trial}"
        for _ in range(40):
            got = proposer.propose(seq_id, prompt, output, max_tokens=k)
            assert got == brute_force(prompt + output, low, high, k), (prompt, output)
            # grow like a decoding sequence: sometimes accept the draft, then one token more
            if got and rng.random() < 0.5:
                output.extend(got[: rng.randrange(len(got) + 1)])
            output.append(rng.randrange(4))
        proposer.forget(seq_id)
    assert proposer._indexes == {}


def test_a_loop_is_continued_around_and_max_tokens_caps_the_draft() -> None:
    proposer = NgramProposer(2, 3, 6)
    assert proposer.propose("a", [7, 1, 2, 1, 2], [], max_tokens=8) == [1, 2, 1, 2, 1, 2]
    assert proposer.propose("a", [7, 1, 2, 1, 2], [1], max_tokens=2) == [2, 1]
    assert proposer.propose("b", [1, 2, 3, 4], [], max_tokens=8) == []  # nothing repeats
    assert proposer.propose("c", [5, 6, 5, 6], [], max_tokens=0) == []


def test_the_prompt_and_output_are_one_sequence() -> None:
    proposer = NgramProposer(2, 2, 3)
    # the suffix "3 4" spans prompt and output; its earlier occurrence is in the prompt
    assert proposer.propose("a", [3, 4, 9, 8, 3], [4], max_tokens=3) == [9, 8, 3]
