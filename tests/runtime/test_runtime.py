"""The runtime processes through their clients: typed messages, aborts, idle behaviour, clean-up."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from radixrelay.config import EngineConfig
from radixrelay.protocol.messages import (
    AbortRequest, FrontendMessage, GenerateRequest, RuntimeMessage, WorkerCommand, WorkerMessage, WorkerStep,
    WorkerStepDone, decoder, encoder,
)
from radixrelay.protocol.step import ExtendItem, PromptLogprobsChunk, StepOutput, StepPlan, TokenLogprobs
from radixrelay.runtime.async_client import AsyncRuntimeClient
from radixrelay.sampling_params import SamplingParams
from tests.runtime.server_process import TINY_ENGINE, pid_alive

pytestmark = pytest.mark.timeout(240)
PACKAGE = Path(__file__).resolve().parents[2] / "radixrelay"
_PICKLERS = re.compile(r"^\s*(import|from)\s+(pickle|cloudpickle|dill|multiprocessing)\b", re.M)


def test_messages_are_typed_and_never_pickled():
    encode = encoder().encode
    plan = StepPlan(7, released=[1], extends=[ExtendItem(2, 0, 5, True, 1, 3)], decodes=[3])
    assert decoder(WorkerCommand).decode(encode(WorkerStep(plan))) == WorkerStep(plan)
    done = WorkerStepDone(StepOutput(7, [2], [9], prompt_logprobs=[
        PromptLogprobsChunk(2, 2, [TokenLogprobs(-0.5, [(4, -0.25)]), TokenLogprobs(-1.0, [])])]))
    assert decoder(WorkerMessage).decode(encode(done)) == done
    request = GenerateRequest(5, [1, 2, 3], SamplingParams(max_tokens=4, stop=("x",)), "salt")
    assert decoder(FrontendMessage).decode(encode(request)) == request
    with pytest.raises(msgspec.ValidationError):          # a frontend message on the wrong channel
        decoder(RuntimeMessage).decode(encode(AbortRequest(5)))
    with pytest.raises(msgspec.ValidationError):
        decoder(FrontendMessage).decode(encode({"type": "generate", "rid": "five"}))
    for path in [*PACKAGE.glob("runtime/*.py"), *PACKAGE.glob("server/*.py"), PACKAGE / "engine.py"]:
        assert not _PICKLERS.search(path.read_text()), path


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_async_client_end_to_end(short_tmp, monkeypatch, tiny_model_dir):
    """On the tiny dummy model (``tests/runtime/server_process.py``): token ids in, token ids out."""
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    asyncio.run(_end_to_end(short_tmp, tiny_model_dir))


async def _end_to_end(tmp_path: Path, model: Path) -> None:
    client = await AsyncRuntimeClient.start(EngineConfig(model=str(model), **TINY_ENGINE, kv_cache_tokens=512,
                                                         page_size=16))
    processes = client._processes
    pids = [p.pid for p in processes.children.values()]
    try:
        # Private socket directory.
        mode = stat.S_IMODE(processes.ipc_dir.stat().st_mode)
        assert processes.ipc_dir.parent == tmp_path and mode == 0o700
        assert client.alive and client.info.kv_cache_tokens == 512

        # A request runs to completion; updates carry logprobs for exactly their tokens.
        updates = [u async for u in client.generate(list(range(10, 40)), SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))]
        assert updates[-1].update.finished and updates[-1].update.finish_reason == "length"
        assert sum(len(u.update.token_ids) for u in updates) == 6
        assert all(len(u.logprobs) == len(u.update.token_ids) for u in updates)

        # Too long for the KV cache: refused with the scheduler's reason.
        with pytest.raises(ValueError, match="KV pages"):
            async for _ in client.generate([1] * 400, SamplingParams(max_tokens=200)):
                pass

        # Closing a stream early aborts it: its KV is freed. What stays is cache: the whole pages
        # of its prompt entered the radix tree when its prefill ended; unlocked, they are evictable.
        assert await client.flush_cache()
        stream = client.generate(list(range(50, 90)), SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(stream)
        assert (await client.stats()).scheduler.num_running == 1
        await stream.aclose()
        deadline = time.monotonic() + 5
        while True:
            sched = (await client.stats()).scheduler
            if sched.num_running == 0 and sched.locked_tokens == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        page_size = client.info.kv_cache_tokens // sched.kv_total_pages
        assert sched.num_running == 0 and sched.locked_tokens == 0
        assert sched.kv_used_pages * page_size == sched.cached_tokens == sched.evictable_tokens == 32

        # An idle runtime sleeps in poll: over 2 s the scheduler and worker use a small fraction of
        # a core (a spinning loop would use all of it). The settle time lets the aborted request's
        # in-flight step and torch's worker threads wind down first.
        await asyncio.sleep(1.0)
        before = [_cpu_seconds(p) for p in pids]
        await asyncio.sleep(2.0)
        used = [_cpu_seconds(p) - b for p, b in zip(pids, before)]
        assert max(used) < 0.5, used
    finally:
        await client.shutdown(drain_timeout=5)
    assert not any(pid_alive(p) for p in pids)
    assert not processes.ipc_dir.exists()


def test_engine_start_failure_is_reported_and_cleaned_up(tmp_path, short_tmp, monkeypatch):
    from radixrelay import Engine

    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    with pytest.raises(RuntimeError, match="worker start-up failed"):
        Engine(model="default", load_format="safetensors")      # the default model is a GGUF file
    assert list(short_tmp.iterdir()) == []
    with pytest.raises(ValueError, match="no such local file"):
        Engine(model=str(tmp_path / "missing-model"))
