"""Long texts tokenize in a worker process: same ids as in the server's own process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hybridkv.models.tokenizer import Tokenizer
from hybridkv.server.offload import TokenizerOffload


def test_worker_process_gives_the_same_ids(checkpoint: Path) -> None:
    tokenizer = Tokenizer(checkpoint)
    offload = TokenizerOffload(tokenizer, str(checkpoint), min_chars=100)
    text = "Ünïcode and <|im_end|> specials, " * 50

    async def run() -> tuple[list[int], list[int]]:
        return await offload.encode(text), await offload.encode(text[:50])

    try:
        long_ids, short_ids = asyncio.run(run())
        assert long_ids == tokenizer.encode(text)
        assert short_ids == tokenizer.encode(text[:50])
        with pytest.raises(ValueError, match="lone surrogate"):
            asyncio.run(offload.encode("x" * 200 + "\ud800"))
    finally:
        offload.shutdown()
