"""CPU per message on one of a rank's streams, without the engine: seal, queue, write, read, open
and hand over, as the engine does for a control message (DESCRIBE, MCAST_END, FIN), over a
loopback TCP connection, both ends in this process.

    .venv/bin/python tools/bench_stream.py --payload 40 --messages 20000 --reps 5

Prints the median and range over the repetitions of this process's CPU per message (both ends).
"""

import argparse
import select
import socket
import statistics
import time

from overcast.transport.stream import Stream
from overcast.wire.auth import Drops, Opener, Sealer
from overcast.wire.header import Kind

KEY, JOB, COMM = b"k" * 16, 1, 2


def run(messages: int, payload: bytes, batch: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    sealer, opener = Sealer(KEY, JOB, COMM, 0), Opener(KEY, JOB, COMM, Drops())
    sender, receiver = Stream(a, 1, opener), Stream(b, 0, opener)
    got = 0

    def deliver(hdr, body):
        nonlocal got
        got += 1
    start = time.process_time()
    for i in range(messages):
        sender.enqueue(sealer.seal_for_stream(Kind.DESCRIBE, i, 1, 0, payload), i)
        if i % batch == batch - 1 or i == messages - 1:
            sender.flush()
            while got <= i:
                select.select([b], [], [], 10.0)
                receiver.read(deliver)
    cpu = time.process_time() - start
    a.close()
    b.close()
    return cpu / messages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--payload", type=int, default=40, help="payload bytes per message")
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--batch", type=int, default=50, help="messages queued per write")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    runs = [run(args.messages, bytes(args.payload), args.batch) for _ in range(args.reps)]
    print(f"{statistics.median(runs) * 1e6:.2f} us per message "
          f"[{min(runs) * 1e6:.2f}-{max(runs) * 1e6:.2f}], {args.payload}-byte payloads, "
          f"{args.batch} per write, {args.reps} runs")


if __name__ == "__main__":
    main()
