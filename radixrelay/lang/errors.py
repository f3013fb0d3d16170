"""Errors of DSL programs, each naming the program line that caused it.

Operations run on background threads (one per program state), so a Python traceback would point
into the executor. Every operation therefore records its ``Origin`` (the user's file, line and
source text) on the calling thread when it is submitted, and ``ProgramError`` reports it.
"""

from __future__ import annotations

import linecache
import sys
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = str(Path(__file__).resolve().parent)


@dataclass(frozen=True)
class Origin:
    """Where in the user's program an operation was written."""

    filename: str
    lineno: int
    function: str

    @property
    def source(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def __str__(self) -> str:
        where = f"{Path(self.filename).name}:{self.lineno} in {self.function}"
        return f"{where}: `{self.source}`" if self.source else where


def caller_origin() -> Origin:
    """The innermost stack frame outside ``radixrelay.lang``: the program line being run."""
    frame = sys._getframe(1)
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return Origin(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


class BackendError(RuntimeError):
    """A backend request failed: HTTP error, refused parameter, malformed response."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ProgramError(RuntimeError):
    """An operation of a program failed; ``origin`` is the program line, ``reason`` why."""

    def __init__(self, origin: Origin, reason: str) -> None:
        super().__init__(f"{origin}: {reason}")
        self.origin = origin
        self.reason = reason
