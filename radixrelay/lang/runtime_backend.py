"""What a program needs from a backend, and what a call reports back.

``Backend`` is the interface the interpreter calls (``OpenAICompatible`` and ``RuntimeEndpoint``
implement it): ``generate`` streams a completion of the state's text, ``score`` gives each
``select`` choice its mean log-probability. ``CallMeta`` is what ``state.meta(name)`` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from radixrelay.lang.chat import RoleMarkers
from radixrelay.lang.expr import Gen


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None       # prompt tokens served from the prefix cache, if reported


@dataclass(frozen=True)
class CallMeta:
    """One backend call of a program. Times are ``time.monotonic()`` seconds."""

    started: float
    finished: float
    usage: Usage | None
    finish_reasons: tuple[str | None, ...] = ()   # gen: one per completion
    scores: tuple[float, ...] = ()                # select: mean logprob per choice (natural log)


@dataclass(frozen=True)
class Generation:
    texts: tuple[str, ...]          # n completions
    meta: CallMeta


class Backend(Protocol):
    markers: RoleMarkers

    def generate(self, prompt: str, gen: Gen, on_text: Callable[[str], None]) -> Generation:
        """Complete ``prompt``; with ``gen.n == 1`` each text delta goes to ``on_text`` as it
        arrives. Raises ``BackendError``."""
        ...

    def score(self, prefix: str, choices: Sequence[str]) -> CallMeta:
        """``meta.scores[i]``: mean log-probability of the tokens of ``choices[i]`` after
        ``prefix``. Raises ``BackendError``."""
        ...

    def prefill(self, prompt: str) -> CallMeta:
        """Have the server compute and cache ``prompt`` (requests extending it then find it in
        the prefix cache). Raises ``BackendError``."""
        ...

    def close(self) -> None: ...


_default: list[Backend] = []
_default_lock = threading.Lock()


def set_default_backend(backend: Backend) -> None:
    """The backend programs use when ``run``/``run_batch`` get no ``backend=``."""
    with _default_lock:
        _default[:] = [backend]


def default_backend() -> Backend:
    with _default_lock:
        if not _default:
            raise RuntimeError("no backend: call rl.set_default_backend(...) or pass backend=")
        return _default[0]
