"""Speculation through the server: ``hybridkv serve --speculative-config JSON`` answers an
OpenAI completion and chat request with the greedy tokens of a server without it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import MODEL_NAME, LiveServer, start_server

from hybridkv.cli import build_parser
from hybridkv.cli.engine_args import engine_config_from_args, model_arg
from hybridkv.engine import LLMEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def speculative(checkpoint: Path, live: LiveServer) -> Iterator[LiveServer]:
    """The shared server's engine options, parsed from a serve command line with
    ``--speculative-config``."""
    options = live.engine.config
    argv = ["serve", str(checkpoint), "--speculative-config", json.dumps(NGRAM)]
    argv += ["--max-model-len", str(options.max_model_len), "--max-num-seqs", "64"]
    argv += ["--cache-memory-gib", str(options.cache_memory_gib)]
    args = build_parser().parse_args(argv)
    engine = LLMEngine(engine_config_from_args(args, model=model_arg(args)))
    assert engine.speculator is not None
    engine.speculator.always_verify = True  # verify every draft: this text may not pay
    server = start_server(engine)
    yield server
    server.stop()


def openai_client(server: LiveServer) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_and_chat_are_the_greedy_answers_without_speculation(
    live: LiveServer, speculative: LiveServer
) -> None:
    prompt = "abcabcabcabc the cat sat on the mat, the cat sat on the"
    messages = [{"role": "user", "content": "repeat: one two one two one two"}]
    answers = []
    for server in (live, speculative):
        client = openai_client(server)
        completion = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0.0, logprobs=1
        )
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0.0
        )
        answers.append(
            (
                completion.choices[0].text,
                completion.choices[0].logprobs.tokens,
                chat.choices[0].message.content,
                completion.usage.completion_tokens,
                chat.usage.completion_tokens,
            )
        )
    assert answers[0] == answers[1]
    assert answers[0][3] == answers[0][4] == 24
    stats = speculative.engine.stats()
    assert stats["speculative_config"]["num_speculative_tokens"] == 3
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
