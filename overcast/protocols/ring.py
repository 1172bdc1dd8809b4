"""Ring AllGather and ReduceScatter as pipelined streams to the ring successor (schedules.ring)."""

from __future__ import annotations

import numpy as np

from overcast.buffers import divide_into, reduce_into
from overcast.protocols.base import STREAM, Accept, Collective, Descriptor, Outgoing, Phase
from overcast.schedules import ring as schedule
from overcast.wire.header import Kind


class _RingStream(Collective):
    """Frame bookkeeping shared by both ring collectives: step s, frame j of block b."""

    ACCEPTS = {Kind.RING_DATA: Accept("_on_data", "predecessor", frozenset((Phase.RECEIVING,)))}

    def __init__(self, seq: int, rank: int, world: int, desc: Descriptor, frame_bytes: int):
        super().__init__(seq, rank, world, desc)
        self.block_bytes = desc.count * desc.dtype.itemsize
        self.layout = schedule.frames(self.block_bytes, frame_bytes, desc.dtype.itemsize)
        self.frames_per_block = len(self.layout)
        self.expected = (world - 1) * self.frames_per_block
        self.arrived = 0
        self.successor = (rank + 1) % world
        self.predecessor = (rank - 1) % world
        self.route = (STREAM, self.successor)

    def start(self, now: float) -> None:
        self.begin()
        if self.expected == 0:
            self.enter(Phase.DRAINING)
        else:
            self.enter(Phase.RECEIVING)
            for j in range(self.frames_per_block):
                self.send_frame(0, j, self.first_payload(j))
        self._check_done()

    def send_frame(self, step: int, j: int, payload) -> None:
        self.queue(
            self.route,
            Outgoing(
                Kind.RING_DATA, self.seq, step * self.frames_per_block + j, payload, self.successor
            ),
        )

    def _on_data(self, hdr, payload: memoryview, now: float) -> None:
        if hdr.chunk >= self.expected:
            self.reject("out_of_range", f"frame {hdr.chunk} is beyond the {self.expected} expected")
        step, j = divmod(hdr.chunk, self.frames_per_block)
        if len(payload) != self.layout[j][1]:
            self.reject(
                "wrong_length",
                f"frame {hdr.chunk} has {len(payload)} bytes, expected {self.layout[j][1]}",
            )
        self.on_frame(step, j, payload)
        self.arrived += 1
        self.progress += 1
        if self.arrived == self.expected:
            self.enter(Phase.DRAINING)
        self._check_done()

    def waiting_for(self) -> str:
        return f"frames from rank {self.predecessor}: {self.arrived} of {self.expected} arrived"

    def begin(self) -> None:
        raise NotImplementedError

    def first_payload(self, j: int):
        """Frame j of this rank's own block, sent at step 0."""
        raise NotImplementedError

    def on_frame(self, step: int, j: int, payload: memoryview) -> None:
        raise NotImplementedError


class RingAllGather(_RingStream):
    """Each rank forwards every block it receives; the output doubles as the forwarding store."""

    def __init__(
        self, seq, rank, world, desc, output: np.ndarray, input: np.ndarray, frame_bytes: int
    ):
        super().__init__(seq, rank, world, desc, frame_bytes)
        self.output = output.view(np.uint8)
        self.input = input.view(np.uint8)

    def begin(self) -> None:
        n = self.block_bytes
        self.output[self.rank * n : (self.rank + 1) * n] = self.input

    def _slice(self, block: int, j: int):
        off, length = self.layout[j]
        start = block * self.block_bytes + off
        return self.output[start : start + length]

    def first_payload(self, j: int):
        return self._slice(schedule.allgather_send_block(self.rank, self.world, 0), j)

    def on_frame(self, step: int, j: int, payload: memoryview) -> None:
        block = schedule.allgather_recv_block(self.rank, self.world, step)
        stored = self._slice(block, j)
        stored[:] = np.frombuffer(payload, np.uint8)
        if step + 1 <= self.world - 2:
            self.send_frame(step + 1, j, stored)


class RingReduceScatter(_RingStream):
    """Each rank combines its contribution with the partial result it receives (sum, max, min
    or product) and forwards it; the partial results in flight are the only extra memory, one
    frame each."""

    def __init__(
        self, seq, rank, world, desc, output: np.ndarray, input: np.ndarray, frame_bytes: int
    ):
        super().__init__(seq, rank, world, desc, frame_bytes)
        self.output, self.input = output, input

    def _elements(self, block: int, j: int) -> slice:
        off, length = self.layout[j]
        size = self.desc.dtype.itemsize
        start = block * self.desc.count + off // size
        return slice(start, start + length // size)

    def begin(self) -> None:
        if self.world == 1:
            self.output[:] = self.input
            if self.desc.op == "avg":
                divide_into(self.output, 1)

    def first_payload(self, j: int):
        block = schedule.reduce_scatter_send_block(self.rank, self.world, 0)
        return self.input[self._elements(block, j)].view(np.uint8)

    def on_frame(self, step: int, j: int, payload: memoryview) -> None:
        block = schedule.reduce_scatter_recv_block(self.rank, self.world, step)
        incoming = np.frombuffer(payload, self.desc.dtype)
        mine = self.input[self._elements(block, j)]
        if step + 1 <= self.world - 2:
            partial = np.empty_like(mine)
            reduce_into(partial, incoming, mine, self.desc.op)
            self.send_frame(step + 1, j, partial.view(np.uint8))
        else:
            off, length = self.layout[j]
            size = self.desc.dtype.itemsize
            out = self.output[off // size : (off + length) // size]
            reduce_into(out, incoming, mine, self.desc.op)
            if self.desc.op == "avg":
                divide_into(out, self.world)


class RingBroadcast(_RingStream):
    """The root's buffer passed along the ring frame by frame, each rank storing every frame in
    place and forwarding it unless its successor is the root: every link carries the buffer
    once, pipelined, whatever P.

    The rank before the root forwards nothing, so no frame shows whether it issued the call:
    every peer's DESCRIBE is awaited, as the datagram protocols await them, so that a call it
    refused fails on every rank rather than completing on the others."""

    verify_every_peer = True

    def __init__(self, seq, rank, world, desc, buffer: np.ndarray, frame_bytes: int):
        super().__init__(seq, rank, world, desc, frame_bytes)
        self.buffer = buffer.view(np.uint8)
        self.root = desc.param
        self.expected = 0 if rank == self.root else self.frames_per_block

    def start(self, now: float) -> None:
        if self.expected:
            self.enter(Phase.RECEIVING)
        else:
            self.enter(Phase.DRAINING)
            if self.world > 1:
                for j in range(self.frames_per_block):
                    self.send_frame(0, j, self._frame(j))
        self._check_done()

    def _frame(self, j: int):
        off, length = self.layout[j]
        return self.buffer[off : off + length]

    def on_frame(self, step: int, j: int, payload: memoryview) -> None:
        stored = self._frame(j)
        stored[:] = np.frombuffer(payload, np.uint8)
        if self.successor != self.root:
            self.send_frame(0, j, stored)
