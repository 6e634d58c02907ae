"""AsyncEngine: an asyncio front for :class:`LLMEngine`, so one process serves many clients.

One background thread owns the engine's step loop: it runs ``engine.step()`` while any
request is unfinished and sleeps on an event otherwise. Each step's outputs are handed to
the event loop in one ``call_soon_threadsafe`` call and land in per-request asyncio queues.
The event loop never runs model code, so streams keep flowing while a step computes, and
every request admitted between two steps joins the next one (continuous batching).

Cancellation: :meth:`AsyncEngine.add_request` returns a :class:`RequestStream`; closing it
before the request finished (a client that disconnected, a cancelled task) aborts the
request, and the engine frees its pages at the next step.

Outputs carry the whole completion so far, so a consumer that falls behind loses nothing by
taking only the newest queued output; :class:`RequestStream` does that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from hybridkv.engine.inputs import PromptType
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


IDLE_POLL_S = 0.01


class EngineDeadError(RuntimeError):
    """The step loop raised; the requests it was running are aborted."""


_Item = RequestOutput | BaseException


class AsyncEngine:
    """Runs an :class:`LLMEngine` in a background thread and streams results to asyncio.

    Args:
        engine: the engine; from :meth:`start` on, only this object's thread steps it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self.log_requests = False  # log each request's id, prompt length and parameters
        # Held around step() and stats(): stats reads scheduler and pool state that a step
        # mutates, and a scrape must not see a half-updated pool.
        self._step_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the step thread; outputs are delivered on ``loop`` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the step thread after its current step; unfinished requests are aborted."""
        if self._thread is None:
            return
        for request_id in list(self._queues):
            self.engine.abort_request(request_id)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ the step thread

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            num_steps = self.engine.num_steps
            try:
                with self._step_lock:
                    outputs = self.engine.step()
            except Exception as exc:  # an engine bug: fail the requests, keep serving
                logger.exception("engine step failed")
                self._post(self._fail_all, EngineDeadError(f"engine step failed: {exc}"))
                self._wake.wait(IDLE_POLL_S)
                continue
            if outputs:
                self._post(self._deliver, outputs)
            elif self.engine.num_steps == num_steps:
                # Nothing ran and nothing moved: only new input can change that, so wait for
                # it (briefly, rather than spinning a core on an engine with stuck requests).
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()
        try:
            with self._step_lock:  # hand back the pages of what shutdown aborted
                self.engine.step()
        except Exception:
            logger.exception("engine step at shutdown failed")

    def _post(self, callback: Any, arg: Any) -> None:
        assert self._loop is not None
        # RuntimeError: the loop closed under us (shutdown), so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, arg)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Runs on the event loop: route each output to its request's queue."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, queue in self._queues.items():
            self.engine.abort_request(request_id)
            queue.put_nowait(exc)

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> RequestStream:
        """Queue a request now (on the event loop's thread); iterate the result for outputs.

        Raises:
            ValueError: the engine refused the request (nothing was queued).
            EngineDeadError: the step loop is not running.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.engine.add_request(request_id, prompt, params)
        if self.log_requests:
            logger.info("request %s: %s, %s", request_id, _prompt_summary(prompt), params)
        self._queues[request_id] = queue
        self._wake.set()
        return RequestStream(self, request_id, queue)

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`add_request` as an async generator; leaving it early aborts the request."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; its pages go back at the next step."""
        self.engine.abort_request(request_id)
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        """``engine.stats()`` between two steps. Blocks up to one step: call it off the loop."""
        with self._step_lock:
            return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """``engine.reset_prefix_cache()`` between two steps. Blocks up to one step: call it
        off the loop."""
        with self._step_lock:
            return self.engine.reset_prefix_cache()

    @property
    def num_open_requests(self) -> int:
        """Requests with a consumer attached (what the server still has to answer)."""
        return len(self._queues)


def _prompt_summary(prompt: PromptType) -> str:
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return f"{len(prompt['prompt_token_ids'])} prompt tokens"
    return f"{len(str(prompt))} prompt characters"


class RequestStream:
    """The outputs of one request as an async iterator; :meth:`close` aborts it if unfinished.

    A class rather than an async generator so that closing is explicit and synchronous:
    the server calls :meth:`close` in a ``finally`` whatever interrupted it.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, queue: asyncio.Queue[_Item]) -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue = queue
        self.finished = False
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty():  # only the newest matters: outputs are cumulative
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True  # the engine front already aborted it
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        """Stop listening; abort the request unless it finished. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._owner._forget(self.request_id)
        if not self.finished:
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:  # a stream dropped without close(): never leak its pages
        if not getattr(self, "closed", True):
            with contextlib.suppress(Exception):  # interpreter teardown: nothing to free
                self._owner.abort(self.request_id)
