"""The scheduler's routing of answers to several HTTP servers: ``id % servers`` names the server."""

from __future__ import annotations

from radixrelay.protocol.messages import (
    FlushCacheReply, RequestRejected, RequestUpdate, RuntimeMessage, RuntimeReady, TokenUpdate, UpdateBatch, decoder,
    encoder,
)
from radixrelay.scheduler.frontend_outboxes import FrontendOutboxes


class Inbox:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.frames.append(data)

    def messages(self) -> list[RuntimeMessage]:
        decode = decoder(RuntimeMessage).decode
        return [decode(f) for f in self.frames]


def update(rid: int, finished: bool = False) -> TokenUpdate:
    return TokenUpdate(RequestUpdate(rid, [rid], finished))


def test_each_server_gets_the_answers_to_its_own_ids():
    inboxes = [Inbox(), Inbox(), Inbox()]
    out = FrontendOutboxes(inboxes, encoder().encode)
    out.updates([update(rid) for rid in (0, 4, 5, 3, 2, 8)])
    out.reply(7, RequestRejected(7, "queue_full", "full"))
    out.reply(2, FlushCacheReply(2, True))
    out.first(RuntimeReady(1, 1, 1))
    got = [inbox.messages() for inbox in inboxes]
    assert [[i.update.rid for i in m.items] for m in got[0] if isinstance(m, UpdateBatch)] == [[0, 3]]
    assert [[i.update.rid for i in m.items] for m in got[1] if isinstance(m, UpdateBatch)] == [[4]]
    assert [[i.update.rid for i in m.items] for m in got[2] if isinstance(m, UpdateBatch)] == [[5, 2, 8]]
    assert isinstance(got[1][-1], RequestRejected) and got[1][-1].rid == 7
    assert isinstance(got[2][-1], FlushCacheReply)
    assert isinstance(got[0][-1], RuntimeReady)          # start-up results go to server 0


def test_one_server_gets_every_batch_whole():
    inbox = Inbox()
    FrontendOutboxes([inbox], encoder().encode).updates([update(rid) for rid in (9, 1, 4)])
    [batch] = inbox.messages()
    assert isinstance(batch, UpdateBatch) and [i.update.rid for i in batch.items] == [9, 1, 4]
