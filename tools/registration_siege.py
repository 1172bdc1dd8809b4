"""What anyone who can reach `overcast aggregator`'s registration port can try, no secret needed:
hold a crowd of connections open, and send headers that announce the largest frame, then junk.
Meanwhile and afterwards a rank registers as a job's ranks do; the aggregator must stay up, serve
both registrations and keep its memory.

    .venv/bin/python tools/registration_siege.py --connections 1500 --junk 12 --junk-bytes 48M

Starts the aggregator (one shard) under `ulimit -Sn NOFILE` (--hard: the hard limit too, so
that it cannot raise it), opens --connections TCP connections one after another and holds them,
then --junk connections each send a valid header announcing a 64 MiB HELLO and up to
--junk-bytes of junk, all at once, while a rank registers; then it closes everything and a rank
registers again. Prints what happened, and the aggregator's RSS (VmRSS once it listens, VmHWM at
the end) and counters; --json prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import sys
import tempfile
import threading
import time
import types

from overcast.bench.soak import status_bytes
from overcast.aggregator.launch import start_aggregator, stop_aggregator
from overcast.transport.rendezvous import register_with_aggregators
from overcast.units import parse_size
from overcast.wire.auth import Drops, Opener, Sealer, derive_key, job_id_of
from overcast.wire.header import AGGREGATOR, HEADER, MAGIC, MAX_PAYLOAD, VERSION, Kind
from overcast.wire.registration import AGGREGATOR_CHALLENGE

JUNK_WRITE = 1 << 20
SETTLE_SECONDS = 30.0  # how long the aggregator may take to answer every connection


def register(address: str, secret: bytes) -> dict:
    """Register rank 0 of a new communicator of 2 as a rank does: the error (None: welcomed)
    and how long it took."""
    salt = os.urandom(16)
    key, job = derive_key(secret, salt, b"comm"), job_id_of(secret)
    comm = int.from_bytes(salt[:4], "little")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    links = types.SimpleNamespace(world=2, udp=udp, multicast=None, mtu=1500,
                                  sealer=Sealer(key, job, comm, 0),
                                  opener=Opener(key, job, comm, Drops()), aggregator_sockets={},
                                  aggregator_names={}, endpoints=[], aggregator_slots=0,
                                  aggregator_error="unregistered")
    started = time.monotonic()
    register_with_aggregators(links, address, secret, salt, 10.0)
    took = time.monotonic() - started
    for sock in links.aggregator_sockets.values():
        sock.close()
    udp.close()
    return {"error": links.aggregator_error, "seconds": round(took, 3)}


def crowd(host: str, port: int, n: int) -> tuple[list[socket.socket], dict]:
    """n connections, opened one after another, then held until the aggregator has answered
    each: greeted (its challenge came; it may shed the connection later), closed before it,
    or neither within SETTLE_SECONDS; or not connected at all (the port gone)."""
    socks = []
    counts = {"greeted": 0, "closed": 0, "unanswered": 0, "not_connected": 0}
    for _ in range(n):
        sock = socket.socket()
        sock.settimeout(SETTLE_SECONDS)
        try:
            sock.connect((host, port))
        except OSError:
            sock.close()
            counts["not_connected"] += 1
            continue
        sock.setblocking(False)
        socks.append(sock)
    got = {sock: b"" for sock in socks}
    deadline = time.monotonic() + SETTLE_SECONDS
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                sock = key.fileobj
                try:
                    data = sock.recv(64)
                except ConnectionError:
                    data = b""
                got[sock] += data
                if not data:
                    counts["closed"] += 1
                    sel.unregister(sock)
                elif len(got[sock]) >= AGGREGATOR_CHALLENGE.size:
                    counts["greeted"] += 1
                    sel.unregister(sock)  # held from here on
        counts["unanswered"] = len(sel.get_map())
    return socks, counts


def junk(host: str, port: int, job: int, nbytes: int, out: list[int]) -> None:
    """A header announcing the largest HELLO, then junk until nbytes are sent or the
    aggregator closes the connection; appends the junk sent (what the kernel took)."""
    sent = 0
    try:
        with socket.create_connection((host, port), timeout=SETTLE_SECONDS) as sock:
            sock.sendall(HEADER.pack(MAGIC, VERSION, Kind.HELLO, job, 0, 0, 0, AGGREGATOR, 0,
                                     MAX_PAYLOAD, 0))
            block = memoryview(os.urandom(JUNK_WRITE))
            while sent < nbytes:
                sent += sock.send(block[:nbytes - sent])
    except OSError:  # closed by the aggregator, as it should
        pass
    out.append(sent)


def siege(connections: int, junk_connections: int, junk_bytes: int, nofile: int,
          hard: bool) -> dict:
    secret = os.urandom(32)
    soft_limit, hard_limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit < connections + 64:  # this process holds the crowd's other ends
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard_limit, hard_limit))
    limit = f"ulimit -{'' if hard else 'S'}n {nofile} && exec \"$@\""
    stats = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
    stats.close()
    proc, address = start_aggregator("127.0.0.1", 0, secrets=[secret.hex()], shards=1,
                                 stats_path=stats.name, prefix=("sh", "-c", limit, "sh"))
    host, port = address.rsplit(":", 1)
    result = {"connections": connections, "junk_connections": junk_connections,
              "junk_bytes": junk_bytes, "nofile": nofile, "hard": hard}
    held = []
    try:
        result["rss_at_start"] = status_bytes(proc.pid, "VmRSS")
        held, result["crowd"] = crowd(host, int(port), connections)
        sent: list[int] = []
        senders = [threading.Thread(target=junk, args=(host, int(port), job_id_of(secret),
                                                       junk_bytes, sent))
                   for _ in range(junk_connections)]
        for sender in senders:
            sender.start()
        result["during"] = register(address, secret)
        for sender in senders:
            sender.join()
        result["junk_sent_bytes"] = sum(sent)
        for sock in held:
            sock.close()
        held = []
        result["after"] = register(address, secret)
        result["alive"] = proc.poll() is None
        if result["alive"]:
            result["peak_rss"] = status_bytes(proc.pid, "VmHWM")
            result["rss_growth"] = result["peak_rss"] - result["rss_at_start"]
    finally:
        for sock in held:
            sock.close()
        stop_aggregator(proc)
        with open(stats.name) as f:
            text = f.read()
        os.unlink(stats.name)
    result["drops"] = json.loads(text)["drops"] if text else None
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=1500)
    p.add_argument("--junk", type=int, default=12, help="connections sending junk")
    p.add_argument("--junk-bytes", default="48M", help="junk each sends at most")
    p.add_argument("--nofile", type=int, default=1024, help="the aggregator's ulimit -n")
    p.add_argument("--hard", action="store_true", help="its hard limit too")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = siege(args.connections, args.junk, parse_size(args.junk_bytes), args.nofile,
                   args.hard)
    if args.json:
        print(json.dumps(result))
        return 0
    mib = 1 << 20
    crowd_counts = result["crowd"]
    print(f"aggregator under ulimit -{'' if args.hard else 'S'}n {args.nofile}: "
          f"{args.connections} connections held ({crowd_counts['greeted']} greeted, "
          f"{crowd_counts['closed']} closed before, {crowd_counts['unanswered']} unanswered, "
          f"{crowd_counts['not_connected']} not connected), "
          f"{args.junk} x {args.junk_bytes} of junk behind 64 MiB headers "
          f"({result['junk_sent_bytes'] / mib:.1f} MiB of it sent before it closed them)")
    for when in ("during", "after"):
        r = result[when]
        print(f"registration {when}: {'welcomed' if r['error'] is None else r['error']} "
              f"in {r['seconds'] * 1000:.0f} ms")
    if result["alive"]:
        print(f"aggregator up; RSS {result['rss_at_start'] / mib:.1f} MiB at start, peak "
              f"{result['peak_rss'] / mib:.1f} MiB: grew {result['rss_growth'] / mib:.1f} MiB")
    else:
        print("aggregator DIED")
    print(f"its counters: {result['drops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
