"""Scheduler-side request state (what it hands out, ``RequestUpdate`` and ``SchedulerStats``, is in
``radixrelay.protocol``).

A ``Request`` is identity (rid, tokens, sampling, salt, arrival, modular spans), phase and progress;
the KV it holds while running is its ``hold`` (``KVHold``), written only by the cache manager
(``radixrelay.scheduler.cache``; ``tests/scheduler/test_kv_owner.py`` checks it).

Index ranges of one request (``L = len(token_ids)``):
- ``token_ids``: ``[0, num_prompt)`` prompt, ``[num_prompt, L)`` sampled outputs; a ``TokenArray`` (one
  int32 buffer, ``radixrelay.radix.tokens``: no Python object per prompt token; indexing gives ints,
  slices lists, ``token_ids.array`` the int32 view the radix tree and the content keys read);
- KV: ``hold.kv_committed`` and ``hold.kv_len`` (``KVHold`` states their ranges and the pages');
- sampled tokens: ``token_ids`` holds those the host knows; ``num_pending`` more are sampled by
  steps in flight (overlap scheduling: the device feeds them to the next step itself);
- prefill phase: ``hold.kv_len < prefill_len`` (= L at admission: prompt, plus outputs after a
  retraction); decode phase afterwards, with ``hold.kv_len == L - 1 + num_pending`` (the newest
  token, known or pending, is fed next);
- output: ``[num_prompt, num_prompt + num_emitted)`` already sent to the caller; later tokens are
  held back while they might begin a stop string;
- modular prompt (``modules`` non-empty, ``radixrelay.modules.compose``): ``token_ids`` starts with the
  spans' tokens (whole pages each); their KV is the spans' own cached paths (each locked, ends in
  ``hold.module_nodes``), so ``hold.pages[:num_shared_pages]`` is those paths' pages in span order and
  the rest (new text, outputs) is private; nothing of it enters the tree. ``rope_runs`` gives the
  RoPE position of each KV index (``compose.positions_of``). A span missing from the tree is computed
  by an internal request (``internal``: negative rid, never reported) keyed by the span's ``key``;
- prompt logprobs (when asked): the logits of positions ``[0, prompt_logprob_pos)`` have given
  theirs (position t: prompt token t + 1), ``[prompt_logprob_pos, num_prompt - 1)`` still owe
  them. A cache match never covers an owing position, so a resumed request recomputes none twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from radixrelay.protocol.step import ModuleSpan
from radixrelay.radix.tokens import TokenArray
from radixrelay.radix.tree import RadixNode
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler.pins import PendingPin


@dataclass(eq=False, slots=True)
class KVHold:
    """The KV pages and radix locks one request holds. Written only by the cache manager
    (``CacheManager``: match and lock, admission and decode pages, step accounting, promotion,
    release); everyone else reads. A WAITING request holds nothing: no pages, no locks,
    ``kv_len == kv_committed == 0``.

    Index ranges (KV positions; ``ps`` the page size):
    - ``[0, kv_committed)``: computed by steps whose output the scheduler has processed;
      ``[kv_committed, kv_len)``: planned by steps still in flight (empty when none is);
    - ``pages[i]`` holds positions ``[i * ps, (i + 1) * ps)``; ``len(pages) * ps >= kv_len``;
    - ``pages[:num_shared_pages]`` are the tree's: the pages of the locked path root -> ``lock_node``
      (or of each ``module_nodes`` path, in span order), computed (``num_shared_pages * ps <=
      kv_committed``) and valid while the locks hold; ``pages[num_shared_pages:]`` belong to the
      request alone.
    """

    pages: list[int] = field(default_factory=list)
    num_shared_pages: int = 0                   # leading pages owned by the tree (locked path)
    lock_node: RadixNode | None = None          # end of the locked path, None when none matched
    module_nodes: list[RadixNode] = field(default_factory=list)   # locked span path ends (modular)
    kv_len: int = 0                             # KV computed or in flight
    kv_committed: int = 0                       # KV of steps whose output was processed

    @property
    def holds_locks(self) -> bool:
        return self.lock_node is not None or bool(self.module_nodes)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[self.num_shared_pages:]


class Phase(enum.Enum):
    WAITING = "waiting"        # queued (new, or retracted: then token_ids already has outputs)
    RUNNING = "running"        # admitted: holds pages and a lock on its matched tree path


@dataclass(eq=False)
class Request:
    rid: int
    token_ids: TokenArray                       # a list or an int32 array given is made one (post-init)
    num_prompt: int
    sampling: SamplingParams
    salt: str | None
    arrival: int                                # FCFS order key
    phase: Phase = Phase.WAITING
    on_worker: bool = False                     # the worker's table holds it (release needed)
    hold: KVHold = field(default_factory=KVHold)    # the KV it holds (the cache manager writes it)
    # -- progress ------------------------------------------------------------------------------
    num_pending: int = 0                        # tokens sampled by steps in flight
    prefill_len: int = 0                        # tokens known at admission (prefill target)
    prompt_logprob_pos: int = 0                 # positions that gave their prompt logprob
    # -- KV tiers and events: content keys of the leading whole pages of token_ids, computed on demand and
    # kept (``radixrelay.scheduler.content_keys``: the part the radix tree holds is read off its nodes) --
    prefix_keys: list[bytes] = field(default_factory=list)   # written by content_keys alone
    events_told: int = 0                  # leading whole pages KV events said the tree holds (kv_events)
    # Truncated prompt (radix/truncation.py): tokens dropped since the previous truncation point (at
    # ``shifted_at``), and the content keys of whole pages of the previous sequence
    # ``token_ids[:shifted_at] + shifted_prefix + token_ids[shifted_at:]`` (where its cached KV lives).
    shifted_prefix: list[int] = field(default_factory=list)
    shifted_at: int = 0
    shifted_keys: list[bytes] = field(default_factory=list)
    host_hint: tuple[int, int] | None = None    # (device match, host tokens after it): lpm's hint
    skipped_fetch: bool = False                 # admitted without waiting for its disk reads (counted once)
    early_load_tried: bool = False              # its host pages were looked for before admission (once)
    # lpm's device match while waiting: (tree version, len(token_ids), matched tokens) (policy.py)
    lpm_match: tuple[int, int, int] | None = None
    # where the last peek at the tree for this request ended (``RadixTree.peek_resumed``): the next
    # resumes there. Valid because a request's token_ids only ever grow.
    tree_hint: tuple[RadixNode, int] | None = None
    # -- modular prompt (see the module docstring) ----------------------------------------------
    modules: list[ModuleSpan] = field(default_factory=list)
    module_ids: list[np.ndarray] = field(default_factory=list)      # each span's token ids, int32 (as modules)
    rope_runs: list[tuple[int, int]] = field(default_factory=list)   # (first KV index, position delta)
    internal: bool = False                      # computes a module span for modular requests
    # -- pins and priority ------------------------------------------------------------------------
    pins: list[PendingPin] = field(default_factory=list)   # asked pins not established yet (pins.py)
    priority: int = 0                           # smaller is admitted first (policy.by_priority)
    queued_at: float = 0.0                      # scheduler clock at arrival (priority ageing)
    # -- reporting ----------------------------------------------------------------------------
    cached_tokens: int | None = None            # prompt tokens served from cache at first admission
    module_tokens: int = 0                      # of which module KV (modular prompts)
    num_emitted: int = 0                        # output tokens already handed to the caller
    # -- host timings (``SchedulerStats.stage_seconds``) --------------------------------------------------
    arrived_s: float = 0.0                      # time.perf_counter() at add_request

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, TokenArray):
            self.token_ids = TokenArray(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def in_prefill(self) -> bool:
        """Prefill work is left to schedule (chunks in flight count as done)."""
        return self.hold.kv_len < self.prefill_len

    @property
    def prefill_committed(self) -> bool:
        """Every prefill chunk's output has been processed."""
        return self.hold.kv_committed >= self.prefill_len

    @property
    def can_decode(self) -> bool:
        """Past prefill and not yet at max_tokens counting the tokens in flight."""
        return not self.in_prefill and self.num_outputs + self.num_pending < self.sampling.max_tokens

    @property
    def reusable_prefix(self) -> int:
        """Tokens a cache match may cover: all known but the last (its logits sample the next
        token) and none whose logits still owe a prompt logprob."""
        if self.sampling.prompt_logprobs is None:
            return len(self.token_ids) - 1
        return min(len(self.token_ids) - 1, self.prompt_logprob_pos)

    def owed_prompt_logprobs(self, num_tokens: int) -> tuple[int, int]:
        """(first position, count) of the prompt logprobs that the next ``num_tokens`` positions
        from ``hold.kv_len`` owe; count 0 when none."""
        if self.sampling.prompt_logprobs is None:
            return 0, 0
        kv_len = self.hold.kv_len
        first = max(kv_len, self.prompt_logprob_pos)
        return first, max(0, min(kv_len + num_tokens, self.num_prompt - 1) - first)
