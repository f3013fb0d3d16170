"""Program states: the interpreter of ``s += ...``, ``s.fork(n)`` and ``s["name"]``.

Execution model. Each state runs its operations in order on its own worker thread (a one-thread
executor), so ``s += rl.gen(...)`` returns at once and the program goes on; reading the state
(``s["x"]``, ``s.text()``, ``s.fork``, ``forks.join()``) waits for what was submitted before it.
Forked branches are separate states with separate threads: a loop ``for f in forks: f += gen``
puts all branches' requests in flight together, and each request carries the branch's full text
(the server's prefix cache finds what the branches share; ``fork`` prefills the shared text once
so that branches starting together do not each compute it). After an operation fails, the state
skips the rest and the error (``ProgramError`` naming the program line) is raised at the next read
and by ``run``.

Invariants: while operations are pending, only the worker thread mutates ``_text``, ``_vars``,
``_metas`` and ``_messages``; other threads touch them only after waiting for ``_pending``. A ``ProgramRun`` owns its states and
closes them all when the program function returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, overload

from radixrelay.lang.runtime_backend import Backend, CallMeta
from radixrelay.lang.errors import BackendError, Origin, ProgramError, caller_origin
from radixrelay.lang.expr import Expr, Gen, Role, RoleBlock, RoleEdge, Select


class ProgramRun:
    """One execution of a program: its backend and every state it created."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.states: list[ProgramState] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def execute(self, func: Callable[..., Any], state: ProgramState, kwargs: dict[str, Any]) -> None:
        """Run the program function, wait for every state, close them; failures land in
        ``self.error`` (the function's own exception, else the first failed operation)."""
        try:
            func(state, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - kept for run() / the state's readers
            self.error = exc
        finally:
            for s in self.states:
                s._wait()
            if self.error is None:
                self.error = next((s._error for s in self.states if s._error is not None), None)
            for s in self.states:
                s._close()
            self.finished.set()


class _TextLog:
    """Text appended to a state, in order, for ``text_iter`` (a reader may follow it live)."""

    def __init__(self) -> None:
        self._chunks: list[tuple[str | None, str]] = []   # (gen variable or None, text)
        self._closed = False
        self._cond = threading.Condition()

    def add(self, var: str | None, text: str) -> None:
        with self._cond:
            self._chunks.append((var, text))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def follow(self) -> Iterator[tuple[str | None, str]]:
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._chunks) > seen or self._closed)
                new, closed = self._chunks[seen:], self._closed
            seen += len(new)
            yield from new
            if closed and not new:
                return


class ProgramState:
    """The ``s`` of a program: its text so far, its variables, and the pending operations."""

    def __init__(self, run: ProgramRun, text: str = "", variables: dict[str, Any] | None = None,
                 metas: dict[str, CallMeta] | None = None, messages: int = 0) -> None:
        self._run = run
        self._text = text
        self._vars: dict[str, Any] = dict(variables or {})
        self._metas: dict[str, CallMeta] = dict(metas or {})
        self._messages = messages          # messages closed so far: the first may add a preamble
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._error: ProgramError | None = None
        self._closed = False
        self._log = _TextLog()
        run.states.append(self)

    # -- what programs write ----------------------------------------------------------------------

    def __iadd__(self, expr: Expr) -> ProgramState:
        origin = caller_origin()
        if not isinstance(expr, (str, Gen, Select, RoleBlock, RoleEdge)):
            raise ProgramError(origin, f"cannot append a {type(expr).__name__}: append text, "
                                       "rl.gen, rl.select, rl.system/user/assistant or "
                                       "rl.assistant_begin/end")
        if self._closed:
            raise ProgramError(origin, "this program has finished; its state is read-only")
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixrelay-lang")
        self._pending = self._worker.submit(self._execute, origin, expr)
        return self

    def fork(self, n: int) -> ForkGroup:
        """``n`` branches continuing from this state (after its pending operations).

        With ``n > 1`` the state's text is prefilled once first, so that the branches, which
        start together, all find it in the server's prefix cache instead of each computing it."""
        origin = caller_origin()
        if n < 1:
            raise ProgramError(origin, f"fork: n must be >= 1, got {n}")
        self._sync()
        if n > 1 and self._text:
            try:
                self._run.backend.prefill(self._text)
            except BackendError as exc:
                raise ProgramError(origin, f"fork: {exc}") from None
        return ForkGroup([ProgramState(self._run, self._text, self._vars, self._metas, self._messages)
                          for _ in range(n)])

    def __getitem__(self, name: str) -> Any:
        self._sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r} in this state; it has {sorted(self._vars)}")
        return self._vars[name]

    def __setitem__(self, name: str, value: Any) -> None:
        """Record a value computed by the program (a vote, a branch's answers) as a variable,
        after the operations submitted before it."""
        self._sync()
        self._vars[name] = value

    def text(self) -> str:
        self._sync()
        return self._text

    def variables(self) -> dict[str, Any]:
        self._sync()
        return dict(self._vars)

    def meta(self, name: str) -> CallMeta:
        """Timing, usage (``cached_tokens``) and scores of the gen/select stored as ``name``."""
        self._sync()
        if name not in self._metas:
            raise KeyError(f"no gen or select named {name!r} in this state; it has {sorted(self._metas)}")
        return self._metas[name]

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Text as it is appended to this state (a branch: from the fork on), live with
        ``run(stream=True)``; with ``name``, only that gen's text. Ends when the program does;
        raises its error."""
        for var, chunk in self._log.follow():
            if name is None or var == name:
                yield chunk
        self._sync()

    @property
    def error(self) -> BaseException | None:
        """The program's error once it finished (``run_batch`` returns failed states too)."""
        return self._run.error if self._run.finished.is_set() else self._error

    # -- the worker thread ------------------------------------------------------------------------

    def _execute(self, origin: Origin, expr: Expr) -> None:
        if self._error is not None:
            return                      # an earlier operation failed: skip the rest
        try:
            self._apply(expr)
        except BackendError as exc:
            self._error = ProgramError(origin, str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure is reported with the program line
            self._error = ProgramError(origin, f"{type(exc).__name__}: {exc}")

    def _apply(self, expr: Expr) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleEdge):
            self._role_edge(expr.role, expr.begin)
        else:
            self._role_edge(expr.role, begin=True)
            for item in expr.content:
                self._apply(item)
            self._role_edge(expr.role, begin=False)

    def _role_edge(self, role: Role, begin: bool) -> None:
        markers = self._run.backend.markers
        if begin:
            self._append(markers.open(role, first=self._messages == 0))
        else:
            self._append(markers.end[role])
            self._messages += 1

    def _gen(self, gen: Gen) -> None:
        result = self._run.backend.generate(self._text, gen, lambda delta: self._append(delta, gen.name))
        value: str | list[str] = result.texts[0] if gen.n == 1 else list(result.texts)
        self._store(gen.name, value, result.meta)

    def _select(self, select: Select) -> None:
        meta = self._run.backend.score(self._text, select.choices)
        best = max(range(len(select.choices)), key=lambda i: meta.scores[i])   # ties: the first
        self._append(select.choices[best], select.name)
        self._store(select.name, select.choices[best], meta)

    def _append(self, text: str, var: str | None = None) -> None:
        self._text += text
        self._log.add(var, text)

    def _store(self, name: str | None, value: Any, meta: CallMeta) -> None:
        if name is not None:
            self._vars[name] = value
            self._metas[name] = meta

    # -- synchronisation --------------------------------------------------------------------------

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def _sync(self) -> None:
        self._wait()
        if self._error is not None:
            raise self._error
        if self._run.finished.is_set() and self._run.error is not None:
            raise self._run.error

    def _close(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._log.close()


class ForkGroup:
    """The branches of ``s.fork(n)``: ``forks[i]`` is a branch, ``forks["name"]`` the list of
    every branch's variable, ``join()`` waits for all of them."""

    def __init__(self, states: list[ProgramState]) -> None:
        self._states = states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self._states)

    @overload
    def __getitem__(self, key: int) -> ProgramState: ...
    @overload
    def __getitem__(self, key: str) -> list[Any]: ...

    def __getitem__(self, key: int | str) -> ProgramState | list[Any]:
        if isinstance(key, str):
            return [s[key] for s in self._states]
        return self._states[key]

    def __setitem__(self, key: int, value: ProgramState) -> None:
        """Lets ``forks[i] += expr`` work (Python stores the branch back); nothing else."""
        if value is not self._states[key]:
            raise TypeError("fork branches cannot be replaced")

    def join(self) -> list[ProgramState]:
        """Wait for every branch; raises the first failed branch's error."""
        for s in self._states:
            s._wait()
        for s in self._states:
            s._sync()
        return list(self._states)
