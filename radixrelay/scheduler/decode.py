"""Decode manager: every running request past prefill decodes one token per step.

Before a request feeds position ``L - 1`` (``L = len(token_ids)``) its pages must cover it, so it
may need one new page. When free plus evictable pages cannot cover every such request, the most
recently admitted running requests are retracted (LIFO: the least progress is lost; with
``enable_priority`` the lowest priority, the largest number, first, then LIFO) until they can:
a retracted request returns to the front of the queue with its outputs and resumes later from its
cached prefix. Retraction needs every sampled token on the host, so with a step in flight
(``can_retract`` False) the manager plans nothing instead and the caller waits for the output.

With overlap a request's newest token may still be in flight: it feeds position ``kv_len`` and
needs pages for ``kv_len + 1`` tokens. A request whose ``max_tokens`` are all sampled or in flight
does not decode again (``Request.can_decode``). Retraction always terminates: a lone request fits the whole cache
(``Scheduler.add_request`` checks it), and everything it does not hold is free or evictable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixrelay.scheduler.cache import CacheManager
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.request import Request


@dataclass
class DecodeSchedule:
    decodes: list[Request] = field(default_factory=list)
    page_appends: list[tuple[Request, list[int]]] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)


class DecodeManager:
    def __init__(self, config: SchedulerConfig, cache: CacheManager,
                 retract: Callable[[Request], None]) -> None:
        self.config = config
        self.cache = cache
        self._retract = retract    # releases the request's KV and requeues it

    def schedule(self, running: list[Request], can_retract: bool = True) -> DecodeSchedule | None:
        """``running`` in admission order; retracted requests are removed from it. None: pages are
        short and ``can_retract`` is False (nothing was changed)."""
        out = DecodeSchedule()
        grow = [r for r in running if self._needs_page(r)]
        if len(grow) > self.cache.available_pages and not can_retract:
            return None
        while len(grow) > self.cache.available_pages:
            victim = running.pop(self._victim(running))
            self._retract(victim)
            out.retracted.append(victim)
            grow = [r for r in grow if r is not victim]
        pages = self.cache.add_decode_pages(grow)      # one eviction pass; one page per request
        assert pages is not None  # len(grow) <= available_pages
        out.page_appends = [(req, [page]) for req, page in zip(grow, pages)]
        out.decodes = [r for r in running if r.can_decode]
        return out

    def _victim(self, running: list[Request]) -> int:
        """Index in ``running`` (admission order) of the request to retract next."""
        if not self.config.enable_priority:
            return len(running) - 1
        return max(range(len(running)), key=lambda i: (running[i].priority, i))

    def _needs_page(self, req: Request) -> bool:
        hold = req.hold
        return req.can_decode and len(hold.pages) < self.config.pages_for(hold.kv_len + 1)
