"""Every message between the runtime's processes, as tagged msgspec structs (msgpack on the wire).

Channels (one ZMQ PUSH -> PULL socket pair each, see ``Endpoints``):

    frontend  --FrontendMessage-->  scheduler  --WorkerCommand-->  worker
    frontend  <--RuntimeMessage--   scheduler  <--WorkerMessage--  worker

Nothing is pickled: each receiver decodes with a ``msgspec.msgpack.Decoder`` typed to its channel's
union, so a malformed or unexpected message fails to decode instead of executing anything. Such a
frame (garbage bytes, a truncated message, another channel's message) is logged and dropped by the
receiver (``radixrelay.proc.child.FrameDecoder``), which keeps serving; each process's counters
count them (``malformed_frames``, summed in ``/metrics``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from radixrelay.config import EngineConfig
from radixrelay.protocol.kv import KVAcks
from radixrelay.protocol.stats import RuntimeStats, WorkerCounters
from radixrelay.protocol.step import ModuleSpan, StepOutput, StepPlan, TokenLogprobs
from radixrelay.sampling_params import SamplingParams

# -- frontend -> scheduler ----------------------------------------------------------------------


class PinSpec(msgspec.Struct, frozen=True):
    """Pin the prompt's first ``num_tokens`` tokens (rounded down to whole pages) in the radix cache for
    ``ttl_s`` seconds after their last use (``radixrelay.scheduler.pins``)."""
    num_tokens: int
    ttl_s: float


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    rid: int
    token_ids: list[int] | bytes      # bytes: int32 little-endian, packed (runtime/token_ids.py)
    sampling: SamplingParams
    cache_salt: str | None = None
    shifted_prefix: list[int] = []    # truncated prompt: see Scheduler.add_request
    shifted_at: int = 0
    modules: list[ModuleSpan] = []    # modular prompt (radixrelay.modules.compose): see Scheduler.add_request
    rope_runs: list[tuple[int, int]] = []
    pins: list[PinSpec] = []          # pinned prefixes of the prompt (Scheduler.add_request)
    priority: int = 0                 # smaller is admitted first (Scheduler.add_request)


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    rid: int


class FlushCacheRequest(msgspec.Struct, tag="flush_cache", frozen=True):
    call_id: int


class StatsRequest(msgspec.Struct, tag="stats", frozen=True):
    call_id: int


class ShutdownRequest(msgspec.Struct, tag="shutdown", frozen=True):
    """Stop the worker and exit; requests still live are dropped (the frontend drains first)."""


FrontendMessage = GenerateRequest | AbortRequest | FlushCacheRequest | StatsRequest | ShutdownRequest

# -- scheduler -> frontend ----------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort"]


class RequestUpdate(msgspec.Struct, frozen=True):
    """What one request produced in one step (or its end). The caller detokenizes ``token_ids``
    in order; on a stop-string finish it drops the last ``trim_chars`` characters of the text of
    all emitted tokens (the stop string and whatever followed it inside the last token)."""

    rid: int
    token_ids: list[int]                        # newly releasable outputs (never a stop token)
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None       # stop token id or stop string that ended it
    trim_chars: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0                  # sampled so far, a matched stop token included
    cached_tokens: int = 0                      # prompt tokens from cache (first admission)
    error: str | None = None                    # worker failure that aborted the request
    module_tokens: int = 0                      # of the cached tokens, module KV (modular prompts)
    # whose fault ``error`` is (OpenAI's error types): the step's ("server_error") or the request's own
    # ("invalid_request_error": e.g. its grammar over its time budget)
    error_type: Literal["server_error", "invalid_request_error"] = "server_error"


class TokenUpdate(msgspec.Struct, frozen=True):
    update: RequestUpdate
    # One entry per token of ``update.token_ids`` when the request asked for logprobs, else None.
    logprobs: list[TokenLogprobs] | None = None
    # On the request's first update, when it asked for prompt logprobs: prompt tokens 1, 2, ...
    # (token 0 has none; all of them unless the request ended early), else None.
    prompt_logprobs: list[TokenLogprobs] | None = None


class UpdateBatch(msgspec.Struct, tag="updates", frozen=True):
    items: list[TokenUpdate]


RejectReason = Literal["invalid", "queue_full"]


class RequestRejected(msgspec.Struct, tag="rejected", frozen=True):
    rid: int
    reason: RejectReason
    message: str


class FlushCacheReply(msgspec.Struct, tag="flush_cache_reply", frozen=True):
    call_id: int
    flushed: bool                     # False: requests were live, nothing was dropped


class StatsReply(msgspec.Struct, tag="stats_reply", frozen=True):
    call_id: int
    stats: RuntimeStats


class RuntimeReady(msgspec.Struct, tag="ready", frozen=True):
    kv_cache_tokens: int              # KV capacity (whole pages)
    max_context: int                  # model's maximum positions
    vocab_size: int
    precision: dict[str, str] = {}    # the precision each part of the model runs in (Precision.describe)


class RuntimeFailed(msgspec.Struct, tag="failed", frozen=True):
    """A child could not start (bad model file, out of memory, ...)."""
    error: str


RuntimeMessage = UpdateBatch | RequestRejected | FlushCacheReply | StatsReply | RuntimeReady | RuntimeFailed

# -- scheduler <-> worker -----------------------------------------------------------------------


class WorkerStep(msgspec.Struct, tag="step", frozen=True):
    plan: StepPlan


class WorkerStop(msgspec.Struct, tag="stop", frozen=True):
    pass


WorkerCommand = WorkerStep | WorkerStop


class WorkerReady(msgspec.Struct, tag="worker_ready", frozen=True):
    num_pages: int                    # KV pages the worker allocated
    max_context: int
    vocab_size: int
    eos_token_ids: list[int]          # from the model's config (the tokenizer adds its own)
    host_pages: int = 0               # KV tier pages in host memory (0: no tiers)
    disk_pages: int = 0               # KV tier pages on disk (0: no disk tier)
    kv_namespace: str = ""            # model + KV layout identity (keys of the lower tiers)
    page_bytes: int = 0               # bytes of one page's KV (all layers, K and V)
    gc_frozen: int = 0                # start-up objects the worker froze out of the garbage collector
    precision: dict[str, str] = {}    # the precision each part of the model runs in (Precision.describe)


class WorkerStepDone(msgspec.Struct, tag="step_done", frozen=True):
    output: StepOutput
    busy_s: float = 0.0               # worker host time on the step: launch, then waiting for and reading results
    launch_s: float = 0.0             # of which: host work until the model's kernels were launched
    device_s: float = 0.0             # the step's time on the device (CUDA events; on the CPU: busy_s)
    capture_s: float = 0.0            # of launch_s: capturing CUDA graphs during this step's launch
    counters: WorkerCounters = msgspec.field(default_factory=WorkerCounters)   # the worker's, cumulative


WorkerMessage = WorkerReady | WorkerStepDone | RuntimeFailed


class RankReport(msgspec.Struct, tag="rank_report", frozen=True):
    """A tensor-parallel rank > 0 to rank 0, after each step it finished: its share of the step's
    transfers (rank 0 acknowledges a transfer to the scheduler only once every rank completed it) and
    its device time."""
    rank: int
    step_id: int
    acks: KVAcks | None = None
    device_s: float = 0.0

# -- process arguments (JSON on the child's command line) ---------------------------------------


class Endpoints(msgspec.Struct, frozen=True):
    """ZMQ addresses of the four channels; the reading side of each binds."""
    frontend_to_scheduler: str
    scheduler_to_frontend: str
    scheduler_to_worker: str
    worker_to_scheduler: str
    # Tensor parallelism: the inboxes of ranks 1..tp-1 (rank 0 forwards every scheduler frame to them)
    # and the file the ranks meet at to form their process group.
    ranks: list[str] = []
    rendezvous: str = ""
    rank_reports: str = ""            # rank 0's inbox for the other ranks' ``RankReport``s
    # Several HTTP server processes (``--api-servers``): the inboxes of servers 1..n-1; server 0's is
    # ``scheduler_to_frontend``. Every server sends on ``frontend_to_scheduler``.
    frontends: list[str] = []

    def sockets(self) -> list[str]:
        """Every ZMQ address (the four channels, then the ranks' inboxes, rank 0's report inbox and the
        other servers' inboxes)."""
        return [self.frontend_to_scheduler, self.scheduler_to_frontend, self.scheduler_to_worker,
                self.worker_to_scheduler, *self.ranks, *([self.rank_reports] if self.rank_reports else []),
                *self.frontends]

    def frontend_inboxes(self) -> list[str]:
        """Each HTTP server's inbox, by server index (one entry for the Engine or a single server)."""
        return [self.scheduler_to_frontend, *self.frontends]


class ChildArgs(msgspec.Struct, frozen=True):
    config: EngineConfig
    endpoints: Endpoints
    parent_pid: int                   # the child exits once this process is gone
    ipc_dir: str                      # the socket directory (``radixrelay.proc.child.leave_socket_dir``)
    log_level: str = "INFO"
    rank: int = 0                     # a worker's tensor-parallel rank


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    """``kind`` is one of the channel unions above."""
    return msgspec.msgpack.Decoder(kind)
