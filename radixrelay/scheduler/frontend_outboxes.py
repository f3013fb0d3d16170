"""The scheduler's sockets to the HTTP servers, one per server process (``--api-servers``).

Routing rule (the invariant every server keeps): a server numbers its request ids and call ids so that
``id % number_of_servers`` is its own index (``AsyncRuntimeClient``); whatever answers a request or a
call goes to that server. With one server (or the ``Engine``) everything goes to the one socket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from radixrelay.protocol.messages import RuntimeMessage, TokenUpdate, UpdateBatch


class Sender(Protocol):
    """A ZMQ PUSH socket, as far as this module uses one."""

    def send(self, data: bytes) -> object: ...


class FrontendOutboxes:
    def __init__(self, sockets: Sequence[Sender], encode: Callable[[RuntimeMessage], bytes]) -> None:
        if not sockets:
            raise ValueError("at least one frontend socket is needed")
        self.sockets = list(sockets)
        self._encode = encode

    def first(self, message: RuntimeMessage) -> None:
        """To server 0, the one that started the runtime (start-up results)."""
        self.sockets[0].send(self._encode(message))

    def reply(self, owner_id: int, message: RuntimeMessage) -> None:
        """To the server whose request id or call id ``owner_id`` is."""
        self.sockets[owner_id % len(self.sockets)].send(self._encode(message))

    def updates(self, items: Sequence[TokenUpdate]) -> None:
        """One ``UpdateBatch`` per server with updates, in the order given."""
        n = len(self.sockets)
        if n == 1:
            self.sockets[0].send(self._encode(UpdateBatch(list(items))))
            return
        by_server: dict[int, list[TokenUpdate]] = {}
        for item in items:
            by_server.setdefault(item.update.rid % n, []).append(item)
        for server, batch in by_server.items():
            self.sockets[server].send(self._encode(UpdateBatch(batch)))
