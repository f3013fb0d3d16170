"""``until_disconnect``: the request's work against the client's disconnect, whichever comes first."""

from __future__ import annotations

import asyncio

import pytest

from radixrelay.server.app import ClientGone, until_disconnect


class _Client:
    """The ASGI receive channel of a request: ``http.disconnect`` after ``after`` seconds."""

    def __init__(self, after: float) -> None:
        self.after = after

    async def receive(self) -> dict:
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}


def test_work_done_first_returns_its_result():
    async def work() -> int:
        await asyncio.sleep(0.01)
        return 7
    assert asyncio.run(until_disconnect(_Client(10.0), work())) == 7


def test_client_gone_first_cancels_the_work():
    """The work is still running when the client leaves: ClientGone (never an InvalidStateError, a 500),
    and the work is cancelled."""
    cancelled = []

    async def work() -> int:
        try:
            await asyncio.sleep(10.0)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 7

    async def main() -> None:
        with pytest.raises(ClientGone):
            await until_disconnect(_Client(0.01), work())
        await asyncio.sleep(0)          # the cancellation lands at the work's next step
        assert cancelled == [True]

    asyncio.run(main())
