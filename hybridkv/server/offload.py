"""Tokenizing long texts without stalling the event loop: a worker process.

Measured (``benchmarks/event_loop_offload.py``, a 4 MB prompt, 150k-token BPE): in a worker
thread, ``encode`` holds the GIL and stalls the loop for the whole call (17 s), and even
``encode_batch``, which lets go of it while it tokenizes, stalls it for ~0.7 s while the
million-token result is built and freed; in a worker process the loop's longest stall was
24 ms. So texts of at least ``min_chars`` go to one spawned worker (started on first use;
it imports only the tokenizer module), shorter ones to a thread, where the hop to a
process would cost more than it saves.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from array import array
from concurrent.futures import ProcessPoolExecutor

from hybridkv.models.tokenizer import Tokenizer, encode_in_worker, load_worker_tokenizer

LARGE_TEXT_CHARS = 1 << 17  # 128 Ki characters: ~10 ms to tokenize in a thread


class TokenizerOffload:
    """``await encode(text)``: token ids, computed off the event loop."""

    def __init__(
        self, tokenizer: Tokenizer, model_dir: str, min_chars: int = LARGE_TEXT_CHARS
    ) -> None:
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.min_chars = min_chars
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _worker(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=load_worker_tokenizer,
                    initargs=(self.model_dir,),
                )
            return self._pool

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Raises:
            ValueError: the text contains a lone surrogate.
        """
        if len(text) < self.min_chars:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(
            self._worker(), encode_in_worker, text, add_special_tokens
        )
        return await asyncio.to_thread(lambda: array("i", data).tolist())

    def shutdown(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
