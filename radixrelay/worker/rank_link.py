"""The report channel between tensor-parallel worker ranks.

Ranks > 0 send rank 0 a ``RankReport`` per finished step (their completed KV transfers and device time)
over a ZMQ channel of their own; rank 0 merges their acknowledgements with its own (``RankAcks``: a
transfer is acknowledged to the scheduler once every rank completed it) and counts each rank's device
seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from radixrelay.protocol.kv import KVAcks
from radixrelay.protocol.messages import ChildArgs, RankReport, encoder
from radixrelay.proc.child import FrameDecoder, parent_gone
from radixrelay.worker.rank_acks import RankAcks

logger = logging.getLogger("radixrelay.worker")


class RankLink:
    """The report channel between tensor-parallel ranks (``RankReport``): ranks > 0 send one per
    finished step; rank 0 merges their KV acknowledgements with its own (``RankAcks``) and counts
    every rank's device time."""

    def __init__(self, rank: int, size: int, socket: zmq.Socket, args: ChildArgs) -> None:
        self.rank, self.size, self.socket, self.args = rank, size, socket, args
        self.merged = RankAcks(size) if rank == 0 else None
        self.device_s = [0.0] * size             # rank 0: device seconds per rank
        self.last_step = [-1] * size             # rank 0: the latest step each rank reported
        self._encode = encoder().encode
        self._decode = FrameDecoder(RankReport, "rank -> rank 0", logger) if rank == 0 else None

    def finished(self, step_id: int, acks: KVAcks | None, device_s: float,
                 until: Callable[[], bool] | None = None) -> KVAcks | None:
        """A step this rank finished. Ranks > 0: sent to rank 0 (returns None). Rank 0: the
        acknowledgements complete on every rank so far. ``until`` (a plan of transfers alone): rank 0 also
        waits for every rank's report of this step, unless ``until()`` turns true first (a new plan came,
        a deadline passed), so that the scheduler does not ask again while the other ranks still copy."""
        if self.rank != 0:
            self.socket.send(self._encode(RankReport(self.rank, step_id, acks, device_s)))
            return None
        self.merged.add(0, acks)
        self.device_s[0] += device_s
        self.last_step[0] = step_id
        while True:
            behind = until is not None and min(self.last_step) < step_id and not until()
            if not self.socket.poll(1 if behind else 0):
                if not behind:
                    break
                if parent_gone(self.args):
                    raise RuntimeError("the runtime's parent exited while rank 0 waited for the other ranks")
                continue
            report = self._decode(self.socket.recv())
            if report is None or not 0 < report.rank < self.size:
                continue
            self.merged.add(report.rank, report.acks)
            self.device_s[report.rank] += report.device_s
            self.last_step[report.rank] = max(self.last_step[report.rank], report.step_id)
        return self.merged.take()
