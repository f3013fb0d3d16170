"""The replicas behind the router and their health.

Replicas come from ``--replica`` URLs and, in precise mode, from the names replicas announce in their KV
events (``radixrelay.router.kv_index``: only names the router's trust admits, while their announcements
are fresh; an announced replica whose announcements expire leaves the pool). Each replica's ``/health``
is polled every ``HEALTH_EVERY_S``; one failed or slow poll (no answer within ``HEALTH_TIMEOUT_S``) or a
connection error while proxying takes it out of the pool at once (within about a second of it stopping),
and its index entries are dropped; it rejoins on its next healthy poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from radixrelay.kv_schema import check_replica_url  # noqa: F401 - the router's name for it

logger = logging.getLogger("radixrelay.router")

HEALTH_EVERY_S = 0.5
HEALTH_TIMEOUT_S = 0.8


@dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0                 # this router's requests sent there and not yet answered
    failures: int = 0                  # health polls and proxy connections that failed, cumulative
    requests: int = 0                  # requests routed there, cumulative
    discovered: bool = False           # announced (KV events), not given: leaves when its announcements expire


@dataclass
class Pool:
    replicas: list[Replica]
    on_leave: Callable[[Replica], None] = lambda replica: None
    # Replicas that announce themselves (their KV events' names, precise mode): asked before every poll;
    # a new, well-formed URL joins the pool (healthy once its /health answers), and an announced replica
    # no longer listed leaves it. Given replicas never leave the list (health polling decides).
    discover: Callable[[], Iterable[str]] | None = None
    _task: asyncio.Task | None = field(default=None, repr=False)
    _refused: set[str] = field(default_factory=set, repr=False)

    def add_discovered(self) -> None:
        if self.discover is None:
            return
        try:
            names = list(self.discover())
        except Exception:  # noqa: BLE001 - health polling must go on: the pool as it is until the next poll
            logger.exception("listing the announced replicas failed; the pool stays as it is")
            return
        announced: set[str] = set()
        for name in names:
            if name in self._refused:
                continue
            try:
                announced.add(check_replica_url(name))
            except ValueError as exc:
                if len(self._refused) < 1024:
                    self._refused.add(name)
                    logger.warning("a replica announced itself as %r, which is no replica URL: %s", name, exc)
        for replica in [r for r in self.replicas if r.discovered and r.url not in announced]:
            self.replicas.remove(replica)
            if replica.healthy:
                replica.healthy = False
                self.on_leave(replica)
            logger.info("replica %s is no longer announced (its KV events stopped): it left the pool", replica.url)
        known = {r.url for r in self.replicas}
        for url in sorted(announced - known):
            self.replicas.append(Replica(url, discovered=True))
            logger.info("replica %s announced itself", url)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def mark_down(self, replica: Replica, why: str) -> None:
        replica.failures += 1
        if replica.healthy:
            replica.healthy = False
            logger.warning("replica %s left the pool: %s", replica.url, why)
            self.on_leave(replica)

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        self.add_discovered()

        async def one(replica: Replica) -> None:
            try:
                ok = (await client.get(f"{replica.url}/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
                why = "/health is not 200"
            except httpx.HTTPError as exc:
                ok, why = False, f"{type(exc).__name__}"
            if ok and not replica.healthy:
                replica.healthy = True
                logger.info("replica %s is in the pool", replica.url)
            elif not ok:
                self.mark_down(replica, why)
        await asyncio.gather(*(one(r) for r in self.replicas))

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.poll_once(client)
            await asyncio.sleep(HEALTH_EVERY_S)
