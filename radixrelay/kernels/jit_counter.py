"""Count the Triton kernel variants that enter this process: compiled, or loaded from Triton's disk cache.

A launch whose (kernel, constexprs, specialised arguments, options) key misses the kernel's in-memory
cache makes a new *variant*: Triton compiles it, or loads it from its disk cache (``~/.triton/cache``),
then runs it. Either stalls the launching thread (compiling: about a second), so a serving worker should
see none after start-up (``radixrelay.worker.warmup``); the worker reports ``counts()`` taken after its
warm-up and subtracts it from later ones.

API::

    install() -> bool       # idempotent; False where this triton has no hooks for it
    counts() -> JitCounts   # variants = compilations + cache_loads (where triton tells them apart)
    compilations() -> int   # variants compiled from source in this process so far
    variants() -> int       # variants that entered this process so far (compiled or loaded)
    recent() -> tuple[str, ...]   # the last few variants, as Triton describes them (kernel, options, types)

Hooks (triton >= 3.4): ``knobs.runtime.jit_post_compile_hook`` fires once per variant (in-memory cache
miss); ``knobs.compilation.listener`` fires inside ``triton.compile`` with ``cache_hit`` (disk cache).
Without the listener every variant counts as a compilation. Hooks already set by someone else keep
being called (ours wraps them). Under ``TRITON_INTERPRET=1`` nothing is compiled and the counts stay 0.

The counter is process-wide by nature (Triton's hooks are process globals), so it lives in this module
as one ``_Counter``; a hook that fails is logged once and never breaks a launch.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RECENT = 32   # descriptions of the last variants kept for logs


@dataclass(frozen=True)
class JitCounts:
    variants: int = 0             # in-memory cache misses: variants that entered the process
    compilations: int = 0         # of which compiled from source (Triton's disk cache missed)
    cache_loads: int = 0          # of which loaded from the disk cache
    compile_s: float = 0.0        # seconds inside triton.compile, loads included (0 without the listener)

    def __sub__(self, other: JitCounts) -> JitCounts:
        return JitCounts(self.variants - other.variants, self.compilations - other.compilations,
                         self.cache_loads - other.cache_loads, self.compile_s - other.compile_s)


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._variants = self._compilations = self._cache_loads = 0
        self._compile_s = 0.0
        self._has_listener = False
        self._recent: deque[str] = deque(maxlen=RECENT)
        self._prev_hook = self._prev_listener = None
        self._failed = False
        # the bound methods handed to Triton, made once: identity tells ours from someone else's
        self._hook, self._listener = self.post_compile_hook, self.listener

    # -- the hooks ---------------------------------------------------------------------------------

    def post_compile_hook(self, *args, **kwargs):
        """``jit_post_compile_hook``: one new variant (compiled or loaded). Returns the wrapped hook's value."""
        try:
            with self._lock:
                self._variants += 1
                if not self._has_listener:
                    self._compilations += 1
                self._recent.append(_describe(kwargs))
        except Exception:  # noqa: BLE001 - counting must never break a launch
            self._fail()
        if self._prev_hook is not None:
            return self._prev_hook(*args, **kwargs)
        return None

    def listener(self, *args, **kwargs) -> None:
        """``compilation.listener``: inside triton.compile, after a disk-cache hit or a compilation."""
        try:
            times = kwargs.get("times")
            seconds = getattr(times, "total", 0) * 1e-6 if times is not None else 0.0     # microseconds
            with self._lock:
                if kwargs.get("cache_hit"):
                    self._cache_loads += 1
                else:
                    self._compilations += 1
                self._compile_s += seconds
        except Exception:  # noqa: BLE001
            self._fail()
        if self._prev_listener is not None:
            self._prev_listener(*args, **kwargs)

    def _fail(self) -> None:
        if not self._failed:
            self._failed = True
            logger.exception("jit_counter: a hook failed; counts may be low from here")

    # -- install / read ----------------------------------------------------------------------------

    def install(self) -> bool:
        knobs = _knobs()
        if knobs is None:
            return False
        with self._lock:
            runtime = knobs.runtime
            if getattr(runtime, "jit_post_compile_hook", None) is not self._hook:
                self._prev_hook = getattr(runtime, "jit_post_compile_hook", None)
                runtime.jit_post_compile_hook = self._hook
            compilation = getattr(knobs, "compilation", None)
            if compilation is not None and hasattr(compilation, "listener"):
                if compilation.listener is not self._listener:
                    self._prev_listener = compilation.listener
                    compilation.listener = self._listener
                self._has_listener = True
        return True

    def uninstall(self) -> None:
        """Put back the hooks found at ``install`` (where ours are still in place)."""
        knobs = _knobs()
        if knobs is None:
            return
        with self._lock:
            if getattr(knobs.runtime, "jit_post_compile_hook", None) is self._hook:
                knobs.runtime.jit_post_compile_hook = self._prev_hook
            compilation = getattr(knobs, "compilation", None)
            if compilation is not None and getattr(compilation, "listener", None) is self._listener:
                compilation.listener = self._prev_listener
            self._prev_hook = self._prev_listener = None
            self._has_listener = False

    def counts(self) -> JitCounts:
        with self._lock:
            return JitCounts(self._variants, self._compilations, self._cache_loads, self._compile_s)

    def recent(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._recent)


def _knobs():
    """``triton.knobs`` (triton >= 3.4), or None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs if hasattr(knobs, "runtime") else None


def _describe(hook_kwargs: dict) -> str:
    """One line for a variant: Triton's own ``repr`` (kernel, launch options, argument types)."""
    text = hook_kwargs.get("repr")
    if text is None:
        fn = hook_kwargs.get("fn")
        text = getattr(fn, "name", "?")
    return str(text)[:400]


_COUNTER = _Counter()


def install() -> bool:
    """Hook the counter into Triton (idempotent). False where this triton offers no hooks (< 3.4)."""
    return _COUNTER.install()


def uninstall() -> None:
    _COUNTER.uninstall()


def counts() -> JitCounts:
    return _COUNTER.counts()


def compilations() -> int:
    return _COUNTER.counts().compilations


def variants() -> int:
    return _COUNTER.counts().variants


def recent() -> tuple[str, ...]:
    return _COUNTER.recent()
