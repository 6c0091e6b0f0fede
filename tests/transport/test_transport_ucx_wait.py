"""`unspun`: a UCXX-style request wait (re-polling through asyncio.sleep(0)) run without busy-waiting.

The coroutines here poll like UCXX's wait does, so no UCX is needed: the result and errors
come through, a cancel reaches the coroutine, a future it awaits is waited on like a task
would, and a pending wait polls a few hundred times at most instead of spinning the loop.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.transport.bulk.ucx import unspun

pytestmark = pytest.mark.timeout(30)


class Request:
    """A stand-in for a UCX request: completed by the event loop after `after_s`."""

    def __init__(self, after_s: float, error: Exception | None = None) -> None:
        self.done, self.error, self.polls = False, error, 0
        asyncio.get_running_loop().call_later(after_s, self.finish)

    def finish(self) -> None:
        self.done = True

    async def wait_yield(self) -> str:  # what UCXX's Request.wait does without its notifier thread
        while not self.done:
            self.polls += 1
            await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        return "received"


async def test_result_comes_through_and_the_wait_does_not_spin() -> None:
    req = Request(0.2)
    assert await unspun(req.wait_yield()) == "received"
    # Polled at most every ~1 ms (POLL_MAX_S) over 0.2 s, ~200 times; a bare sleep(0) loop polls
    # tens of thousands of times in that time. Load can only lower the count.
    assert 1 <= req.polls < 1000, req.polls


async def test_error_comes_through() -> None:
    with pytest.raises(ConnectionError, match="peer gone"):
        await unspun(Request(0.01, ConnectionError("peer gone")).wait_yield())


async def test_already_complete_returns_without_waiting() -> None:
    async def done() -> int:
        return 7

    assert await unspun(done()) == 7


async def test_a_future_it_awaits_is_waited_on() -> None:
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.02, fut.set_result, 5)

    async def on_future() -> int:
        await asyncio.sleep(0)
        return await fut + 1

    assert await unspun(on_future()) == 6

    bad: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.02, bad.set_exception, RuntimeError("cancelled request"))

    async def on_bad() -> int:
        return await bad

    with pytest.raises(RuntimeError, match="cancelled request"):
        await unspun(on_bad())


async def test_cancel_reaches_the_coroutine() -> None:
    unwound, spun = asyncio.Event(), asyncio.Event()

    async def pending() -> None:
        try:
            while True:
                spun.set()
                await asyncio.sleep(0)
        finally:
            unwound.set()

    task = asyncio.ensure_future(unspun(pending()))
    await asyncio.wait_for(spun.wait(), 10)  # it is inside the coroutine's loop
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert unwound.is_set()

    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.Event()

    async def on_future() -> int:
        waiting.set()
        return await fut

    task = asyncio.ensure_future(unspun(on_future()))
    await asyncio.wait_for(waiting.wait(), 10)  # it waits on the future
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_gpu_buffers_keep_ucxx_own_wait_and_host_buffers_are_unspun() -> None:
    import numpy as np

    from miles.transport.bulk.ucx import ucx_wait

    async def op() -> int:
        return 7

    for buf in (np.zeros(4, np.uint8), torch.zeros(4)):  # host memory: through unspun
        inner = op()
        wrapped = ucx_wait(inner, buf)
        assert wrapped is not inner
        assert asyncio.run(wrapped) == 7  # type: ignore[arg-type]
    if torch.cuda.is_available():
        gpu = op()
        assert ucx_wait(gpu, torch.zeros(4, device="cuda")) is gpu  # as measured on the H200
        gpu.close()
