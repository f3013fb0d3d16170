"""``@rl.function``: a program, run once (``run``) or over many inputs (``run_batch``)."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Protocol

from radixrelay.lang.runtime_backend import Backend, default_backend
from radixrelay.lang.state import ProgramRun, ProgramState


class Program:
    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def run(self, *, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program on ``kwargs``; returns its final state, or raises its error.
        ``stream=True`` returns at once: follow ``state.text_iter()`` (it raises the error)."""
        run = ProgramRun(backend or default_backend())
        state = ProgramState(run)
        if stream:
            threading.Thread(target=run.execute, args=(self.func, state, kwargs), daemon=True,
                             name=f"radixrelay-program-{self.func.__name__}").start()
            return state
        run.execute(self.func, state, kwargs)
        if run.error is not None:
            raise run.error
        return state

    def run_batch(self, batch_kwargs: Iterable[Mapping[str, Any]], *, backend: Backend | None = None,
                  num_threads: int | None = None, progress_bar: bool = False) -> list[ProgramState]:
        """Run the program once per kwargs mapping, ``num_threads`` at a time (default: all of
        them, up to 64). States come back in input order; a failed program's state has ``error``
        set and raises it when read, so one failure does not lose the other results."""
        items = [dict(kw) for kw in batch_kwargs]
        chosen = backend or default_backend()
        states: list[ProgramState | None] = [None] * len(items)
        with ThreadPoolExecutor(num_threads or max(1, min(64, len(items)))) as pool:
            futures = {pool.submit(self._run_recorded, chosen, kw): i for i, kw in enumerate(items)}
            bar = _progress(len(items)) if progress_bar else None
            try:
                for future in as_completed(futures):
                    states[futures[future]] = future.result()
                    if bar is not None:
                        bar.update(1)
            finally:
                if bar is not None:
                    bar.close()
        return [s for s in states if s is not None]

    def _run_recorded(self, backend: Backend, kwargs: dict[str, Any]) -> ProgramState:
        run = ProgramRun(backend)
        state = ProgramState(run)
        run.execute(self.func, state, kwargs)
        return state

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Inside another program, ``prog(s, ...)`` runs this one on the same state."""
        if not isinstance(s, ProgramState):
            raise TypeError(f"{self.func.__name__} is a radixrelay program: call "
                            f"{self.func.__name__}.run(...) or .run_batch([...]), or "
                            f"{self.func.__name__}(s, ...) inside another program")
        return self.func(s, *args, **kwargs)


def function(func: Callable[..., Any]) -> Program:
    """Decorator: ``def prog(s, ...)`` becomes a ``Program``."""
    return Program(func)


class _Bar(Protocol):
    def update(self, n: int) -> Any: ...
    def close(self) -> None: ...


class _TextBar:
    """A one-line progress bar on stderr, for when tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self._draw()

    def update(self, n: int) -> None:
        self.done += n
        self._draw()

    def _draw(self) -> None:
        filled = 30 * self.done // max(self.total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _progress(total: int) -> _Bar:
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextBar(total)
    return tqdm(total=total, desc="run_batch")
