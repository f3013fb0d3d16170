"""How a step runs on the device: one pure function of facts of the plan and the persistent batch.

    path           when                                                   may decline (then the next)
    ADVANCE        decode-only, the last graph step's rows in the same    the graph: another bucket, launch
                   rows (``DeviceBatch.arrange``), none changed, every    shape or shared-run capacity, a
                   row's page list holding its new position               page write past its columns
    PATCH_ROWS     as ADVANCE, some rows changed (joins, leaves; at most  as ADVANCE
                   ``MAX_PATCH_ROWS``): those rows' values from the host;
                   not with modular rows resident (RoPE deltas)
    DECODE_GRAPH   decode-only, decode graphs                             page lists wider than the graphs;
                                                                          an uncaptured size class deferred
    EXTEND_ROWS    extends of at most ``small_extend_rows`` tokens in all  page lists wider than the graphs;
                   (one decode-graph row each, the decodes after them),   an uncaptured size class deferred
                   each with at most one logits row, no KV tier loads in
                   flight (a decode graph has no per-layer waits for them)
    PIECEWISE      the step's tokens fit the captured piecewise graphs    never (the last candidate)
    EAGER          otherwise                                              never (the last candidate)

``choose_path`` returns the candidates in order; the model runner runs the first that takes the step. The
last is PIECEWISE or EAGER; a decode graph may defer an uncaptured size class only when it is PIECEWISE
(``StepPath.defer``). O(1); no torch.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Path(enum.Enum):
    ADVANCE = "advance"
    PATCH_ROWS = "patch rows"
    DECODE_GRAPH = "decode graph"
    EXTEND_ROWS = "extend rows"
    PIECEWISE = "piecewise"
    EAGER = "eager"


class StepFacts(NamedTuple):
    """What the choice reads: of the plan (after the batch's row order), of the resident requests, of the
    persistent batch and of the worker's graphs."""

    decodes: int              # decode rows
    extends: int              # extend chunks
    extend_tokens: int        # tokens the extends compute
    extend_logits: int        # most logits rows of one extend (prompt logprobs: more than 1)
    tier_loads: bool          # KV tier loads in flight (layer by layer, waited for before attention)
    changed: int | None       # rows of a decode-only step that hold another request than in the last graph
                              # step; None: the step does not continue it (or no graph step before)
    modular: bool             # some resident request has RoPE position deltas (modular prompts)
    pages_hold: bool          # every decode's page list holds its new position (read when ``changed`` is set)
    graph_rows: int           # rows of the largest decode graph (0: no decode graphs)
    small_extend_rows: int    # most extend tokens a step runs as decode-graph rows
    piecewise_tokens: int     # most tokens a step runs on the piecewise graphs (0: none)


class StepPath(NamedTuple):
    candidates: tuple[Path, ...]   # in order; the last never declines
    defer: bool                    # a decode graph may hand an uncaptured size class back (PIECEWISE is last)


def _answers(*first: Path) -> tuple[StepPath, StepPath]:
    """(the answer ending with EAGER, the answer ending with PIECEWISE): built once, indexed by a bool."""
    return StepPath(first + (Path.EAGER,), False), StepPath(first + (Path.PIECEWISE,), True)


_PACKED = _answers()
_ADVANCE = _answers(Path.ADVANCE, Path.DECODE_GRAPH)
_PATCH_ROWS = _answers(Path.PATCH_ROWS, Path.DECODE_GRAPH)
_DECODE_GRAPH = _answers(Path.DECODE_GRAPH)
_EXTEND_ROWS = _answers(Path.EXTEND_ROWS)


def choose_path(f: StepFacts) -> StepPath:
    """The ordered paths of a step (module docstring). A step has at least one extend or decode."""
    piecewise = f.extend_tokens + f.decodes <= f.piecewise_tokens
    if not f.graph_rows:
        return _PACKED[piecewise]
    if not f.extends:
        if f.changed is None or not f.pages_hold:
            return _DECODE_GRAPH[piecewise]
        if not f.changed:
            return _ADVANCE[piecewise]
        if f.modular:                                # a patched row's RoPE delta would be 0: fill them all
            return _DECODE_GRAPH[piecewise]
        return _PATCH_ROWS[piecewise]
    if (not f.tier_loads and f.extend_tokens <= f.small_extend_rows
            and f.extend_tokens + f.decodes <= f.graph_rows and f.extend_logits <= 1):
        return _EXTEND_ROWS[piecewise]
    return _PACKED[piecewise]
