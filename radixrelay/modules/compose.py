"""From a prompt plan to what the scheduler serves: module spans whose KV is reused, then new text.

Pure: no torch, no tokenizer (the plan already holds token ids).

A prompt plan (``layout.PromptPlan``) is composed one of two ways:

* **Prefix-only** (exact): when the plan's tokens, in plan order, sit at positions ``0, 1, 2, ...``
  (e.g. the first module of a schema, or a scaffold, then new text), the prompt is an ordinary token
  sequence. It is served as a plain prompt: plain prefix caching reuses its KV, token-identical to
  sending the same tokens without a schema.
* **Modular** (the Prompt Cache approximation): every imported module (or anonymous segment, or a
  scaffold replacing its members) becomes a ``ModuleSpan``: its tokens, with parameter values written
  over their placeholders, each at its schema position. Its KV is computed once per (model, schema,
  module, values, salt) in a span of its own (modules never attend each other) and cached in the
  radix tree under ``ModuleSpan.key``. The request's KV is the spans' pages, in plan order, then the
  new text, which attends every span and takes its positions from the plan.

Pages: a request's page table concatenates whole pages, so each span is padded to whole pages with
the placeholder token at the positions following its last token. New text therefore also attends
those pads (a few whitespace-like tokens per module, as the paper argues harmless); prefix-only
prompts have none.

RoPE positions vs KV index: a span's token ``i`` sits at KV index ``i`` of its own span but at a
schema position ``p_i``. ``rope_runs`` encodes ``p_i`` compactly as runs ``(first index, delta)``:
from ``first`` on (until the next run) the position is ``index + delta``. The worker applies them
(``AdmittedRequest.rope_runs``); a decode continues with the last run's delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layout import ModuleSegment, ParamSegment, PromptPlan, SchemaLayout, TextSegment
from .pml import SchemaError
from radixrelay.protocol.step import ModuleSpan, positions_of

KEY_SEP = "\x1f"


@dataclass(frozen=True)
class ComposedPrompt:
    """What the scheduler serves for one prompt. ``modules`` empty: a plain (prefix-only) prompt."""

    token_ids: list[int]                # the spans' tokens (padded), then the new text
    modules: list[ModuleSpan]
    rope_runs: list[tuple[int, int]]    # positions of the whole sequence (the spans' part unused)
    module_tokens: int                  # span tokens served from module KV (padding excluded)
    end_position: int                   # position the first generated token takes

    @property
    def is_modular(self) -> bool:
        return bool(self.modules)


def rope_runs(positions: Sequence[int], first_index: int = 0) -> list[tuple[int, int]]:
    """Runs ``(index, delta)`` of ``positions[i] = first_index + i + delta`` (a new run where delta changes)."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(positions):
        delta = p - (first_index + i)
        if not runs or runs[-1][1] != delta:
            runs.append((first_index + i, delta))
    return runs


def module_key(digest: str, kind: str, name: str, salt: str | None) -> str:
    """Cache namespace of a span: never equal to a plain request's salt (it holds the separator)."""
    return KEY_SEP.join((salt or "", kind, digest, name))


def compose(lay: SchemaLayout, plan: PromptPlan, *, digest: str, page_size: int, placeholder_id: int,
            salt: str | None = None, suffix_ids: Sequence[int] = ()) -> ComposedPrompt:
    """Compose ``plan`` (of a prompt against ``lay``) for serving; ``digest`` identifies the model and
    the schema's text (``registry.schema_digest``); ``suffix_ids`` are appended as new text (e.g. the
    chat template's generation prompt). Raises SchemaError for a prompt with no new text after modules."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    spans = _spans(lay, plan)
    texts: list[tuple[list[int], list[int]]] = []        # (tokens, positions) of new text, in order
    order: list[tuple[str, int]] = []                     # ("span" | "text", index), plan order
    for seg in plan.segments:
        if isinstance(seg, TextSegment):
            order.append(("text", len(texts)))
            texts.append((list(seg.token_ids), list(seg.positions)))
        elif isinstance(seg, ModuleSegment) and seg.name in spans.first_of:
            order.append(("span", spans.first_of[seg.name]))
    if suffix_ids:
        texts.append((list(suffix_ids), list(range(plan.end, plan.end + len(suffix_ids)))))
        order.append(("text", len(texts) - 1))
    end = plan.end + len(suffix_ids)

    # Prefix-only: positions 0, 1, 2, ... in plan order -> a plain prompt.
    flat_ids: list[int] = []
    flat_pos: list[int] = []
    for kind, i in order:
        ids, pos = (spans.items[i][1], spans.items[i][2]) if kind == "span" else texts[i]
        flat_ids.extend(ids)
        flat_pos.extend(pos)
    if flat_pos == list(range(len(flat_pos))):
        if not flat_ids:
            raise SchemaError(f"prompt against schema {lay.schema_name} has no tokens")
        return ComposedPrompt(flat_ids, [], [], 0, end)

    text_ids = [t for ids, _ in texts for t in ids]
    if not text_ids:
        raise SchemaError("a modular prompt needs new text after its modules (a question, or the "
                          "assistant's turn) to compute the first token from")
    token_ids: list[int] = []
    modules: list[ModuleSpan] = []
    for key_name, ids, pos in spans.items:
        pad = -len(ids) % page_size
        last = pos[-1] if pos else 0
        padded_pos = list(pos) + list(range(last + 1, last + 1 + pad))
        kind, name = key_name
        modules.append(ModuleSpan(module_key(digest, kind, name, salt), list(ids) + [placeholder_id] * pad,
                                  rope_runs(padded_pos), len(ids)))
        token_ids.extend(modules[-1].token_ids)
    text_pos = [p for _, pos in texts for p in pos]
    runs = rope_runs(text_pos, first_index=len(token_ids))
    return ComposedPrompt(token_ids + text_ids, modules, runs, sum(m.num_real for m in modules), end)


@dataclass
class _Spans:
    items: list[tuple[tuple[str, str], list[int], list[int]]]   # ((kind, name), tokens, positions)
    first_of: dict[str, int]            # plan module name -> its span's index (a scaffold: first member)


def _spans(lay: SchemaLayout, plan: PromptPlan) -> _Spans:
    """One span per imported module with its parameter values written in; a scaffold whose modules
    are all imported replaces them (largest first, never two sharing a module). A span's cache key
    does not depend on parameter values: its tokens do, so the radix tree keeps one entry per distinct
    set of values, all sharing the pages before the first parameter."""
    values: dict[str, list[int]] = {}
    names: list[str] = []
    for seg in plan.segments:
        if isinstance(seg, ModuleSegment):
            m = lay.modules[seg.name]
            if not m.token_ids:
                continue
            names.append(seg.name)
            values[seg.name] = list(m.token_ids)
        elif isinstance(seg, ParamSegment):
            offset, _ = lay.modules[seg.module].params[seg.name]
            values[seg.module][offset:offset + len(seg.token_ids)] = seg.token_ids
    taken: dict[str, str] = {}
    for scaffold in sorted(plan.scaffolds, key=lambda s: -len(lay.scaffolds[s])):
        members = lay.scaffolds[scaffold]
        if not any(m in taken for m in members):
            taken.update((m, scaffold) for m in members)
    items: list[tuple[tuple[str, str], list[int], list[int]]] = []
    first_of: dict[str, int] = {}
    for scaffold in dict.fromkeys(taken.values()):      # scaffold spans: members in schema order
        members = [m for m in lay.modules if taken.get(m) == scaffold and m in values]
        ids = [t for m in members for t in values[m]]
        pos = [p for m in members for p in lay.modules[m].positions]
        first = min(members, key=names.index)
        first_of[first] = len(items)
        items.append((("scaffold", scaffold), ids, pos))
    for name in names:
        if name in taken:
            continue
        first_of[name] = len(items)
        items.append((("module", name), values[name], list(lay.modules[name].positions)))
    return _Spans(items, first_of)

