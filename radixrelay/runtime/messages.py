"""Every message between the runtime's processes, as tagged msgspec structs (msgpack on the wire).

Channels (one ZMQ PUSH -> PULL socket pair each, see ``launcher.Endpoints``):

    frontend  --FrontendMessage-->  scheduler  --WorkerCommand-->  worker
    frontend  <--RuntimeMessage--   scheduler  <--WorkerMessage--  worker

Nothing is pickled: each receiver decodes with a ``msgspec.msgpack.Decoder`` typed to its channel's
union, so a malformed or unexpected message fails to decode instead of executing anything. Such a
frame (garbage bytes, a truncated message, another channel's message) is logged and dropped by the
receiver (``child.FrameDecoder``), which keeps serving; ``RuntimeStats.malformed_frames`` counts them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from radixrelay.config import EngineConfig
from radixrelay.runtime.gc_control import GcStats
from radixrelay.worker.protocol import ModuleSpan
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler.audit import KVAudit
from radixrelay.scheduler.request import RequestUpdate, SchedulerStats
from radixrelay.worker.protocol import StepOutput, StepPlan, TokenLogprobs

# -- frontend -> scheduler ----------------------------------------------------------------------


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    rid: int
    token_ids: list[int] | bytes      # bytes: int32 little-endian, packed (runtime/token_ids.py)
    sampling: SamplingParams
    cache_salt: str | None = None
    shifted_prefix: list[int] = []    # truncated prompt: see Scheduler.add_request
    shifted_at: int = 0
    modules: list[ModuleSpan] = []    # modular prompt (radixrelay.modules.compose): see Scheduler.add_request
    rope_runs: list[tuple[int, int]] = []


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


class RuntimeStats(msgspec.Struct, frozen=True):
    scheduler: SchedulerStats
    steps: int                        # steps the worker ran
    computed_tokens: int              # tokens run through the model (cache hits excluded)
    decode_steps: int                 # steps with at least one decode row
    cascade_steps: int                # decode steps that carried a cascade plan
    cascade_groups: int = 0           # cascade groups summed over steps
    cascade_levels: int = 0           # cascade levels summed over steps
    cascade_tokens_read_once: int = 0  # KV token reads saved: (members - 1) * tokens, per group and step
    # Where the serving loop's time goes (seconds, summed over steps; with overlap the worker's host
    # work, the scheduler's and the device's run at the same time):
    worker_busy_s: float = 0.0        # worker host time on steps (launch + waiting for and reading results)
    worker_launch_s: float = 0.0      # of which host work before the model's kernels were all launched
    scheduler_busy_s: float = 0.0     # scheduling steps and processing their outputs
    worker_device_s: float = 0.0      # device time of the steps (device busy fraction = this / wall time)
    jit_after_ready: int = 0          # Triton kernel variants compiled (or loaded) after ready: 0 expected
    graph_captures: int = 0           # CUDA graphs captured (start-up included)
    graph_replays: int = 0            # steps that replayed a CUDA graph
    eager_steps: int = 0              # steps whose forward ran eagerly
    # Prefill cascade (extend rows reading a cached run shared between requests once, decided per step by
    # the worker), cumulative:
    prefill_cascade_steps: int = 0
    prefill_cascade_runs: int = 0
    prefill_cascade_tokens_read_once: int = 0
    prefill_long_prefix_runs: int = 0  # long cached prefixes of short extends read split along their length
    # KV pages and radix locks by holder, and check_integrity's verdict, taken when these stats were
    # asked for (None from a runtime that does not audit):
    kv_audit: KVAudit | None = None
    # Frames dropped because they did not decode as their channel's messages (garbage, truncated,
    # another channel's message), cumulative over the scheduler, the worker (as of its latest step
    # output) and the frontend's inbox:
    malformed_frames: int = 0
    # Decode-graph steps (cumulative, of graph_replays): advanced on the device (the previous step's rows
    # one token further: no batch packing on the host), and run on a larger graph covering their size class;
    # of the advanced ones, those whose changed rows (requests joined, left) were patched in place; and
    # decode steps of a size class no captured graph covered yet, run on the piecewise graphs instead:
    decode_steps_advanced: int = 0
    decode_steps_covered: int = 0
    decode_steps_patched: int = 0
    decode_steps_deferred: int = 0
    # Steps with decode rows and no extends (cumulative): how many, their decode rows summed, and the
    # worker's launch time on them (of worker_launch_s; mixed steps are the rest):
    decode_only_steps: int = 0
    decode_only_rows: int = 0
    decode_only_launch_s: float = 0.0    # graph captures excluded (they are in graph_capture_s)
    graph_capture_s: float = 0.0      # worker launch time spent capturing CUDA graphs (all steps)
    # Python garbage collection per process (``radixrelay.runtime.gc_control``): the worker's as of its
    # latest step output, the scheduler's, and the frontend's (filled in by the server, empty elsewhere):
    worker_gc: GcStats = GcStats()
    scheduler_gc: GcStats = GcStats()
    frontend_gc: GcStats = GcStats()


class StatsReply(msgspec.Struct, tag="stats_reply", frozen=True):
    call_id: int
    stats: RuntimeStats


class RuntimeReady(msgspec.Struct, tag="ready", frozen=True):
    kv_cache_tokens: int              # KV capacity (whole pages)
    max_context: int                  # model's maximum positions
    vocab_size: int


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


class WorkerStepDone(msgspec.Struct, tag="step_done", frozen=True):
    output: StepOutput
    busy_s: float = 0.0               # worker host time on the step: launch, then waiting for and reading results
    launch_s: float = 0.0             # of which: host work until the model's kernels were launched
    device_s: float = 0.0             # the step's time on the device (CUDA events; on the CPU: busy_s)
    jit_after_ready: int = 0          # Triton kernel variants the worker compiled (or loaded) since ready
    graph_captures: int = 0           # cumulative since start: CUDA graphs captured ...
    graph_replays: int = 0            # ... steps that replayed one ...
    eager_steps: int = 0              # ... and steps run eagerly
    prefill_cascade: tuple[int, int, int, int] = (0, 0, 0, 0)   # cumulative: steps, runs, tokens read once,
                                                                # long-prefix runs (PrefillCascadeCounters)
    malformed_frames: int = 0         # cumulative: frames the worker dropped (see RuntimeStats)
    decode_graph_steps: tuple[int, int, int, int] = (0, 0, 0, 0)   # cumulative: decode steps advanced,
                                                                   # covered, patched, deferred (RuntimeStats)
    gc: GcStats = GcStats()           # cumulative: the worker's garbage collections
    capture_s: float = 0.0            # of launch_s: capturing CUDA graphs during this step's launch


WorkerMessage = WorkerReady | WorkerStepDone | RuntimeFailed

# -- process arguments (JSON on the child's command line) ---------------------------------------


class Endpoints(msgspec.Struct, frozen=True):
    """ZMQ addresses of the four channels; the reading side of each binds."""
    frontend_to_scheduler: str
    scheduler_to_frontend: str
    scheduler_to_worker: str
    worker_to_scheduler: str


class ChildArgs(msgspec.Struct, frozen=True):
    config: EngineConfig
    endpoints: Endpoints
    parent_pid: int                   # the child exits once this process is gone
    ipc_dir: str                      # the socket directory (``child.leave_socket_dir``)
    log_level: str = "INFO"


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    """``kind`` is one of the channel unions above."""
    return msgspec.msgpack.Decoder(kind)
