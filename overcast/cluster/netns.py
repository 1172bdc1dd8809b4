"""The emulated cluster: P hosts as network namespaces on a Linux bridge that plays the switch.

    host i (netns oc-<run>-h<i>)        switch (netns oc-<run>-sw)       service (oc-<run>-svc)
      eth0 198.18.0.(i+1)  ==veth==  h<i> --- br0 --- svc  ==veth==  eth0 198.18.255.1
                                          br0 --- svc<a>  ==veth==  eth0 198.18.255.(a+1)

Each host link is shaped separately per direction with tbf, as a full-duplex NIC is: on the
host's eth0 (its send direction) and on the switch's port h<i> (its receive direction, where a
switch port drops when more arrives than it can send). The service attachments stand for the
aggregators of in-network reduction, one each (`aggregators`; the first is the service's):
unshaped by default, as the switch's own compute behind its internal fabric, or shaped at
`aggregator_bits_per_s` each way, as aggregator hosts whose NICs are slower than P links. The
switch can drop the multicast it would send to some hosts (`drop_multicast`), as a network
without multicast does.

Each end that stands for a host's or an aggregator's NIC has GRO on, as a NIC has it (a veth's
is off by default): back-to-back datagrams of one flow climb the receive path as one
super-packet, which a UDP_GRO socket reads in one call. The switch's ports do not coalesce.

Everything is created under one run id, so concurrent runs never collide, and removed on exit,
on error, on Ctrl-C and on SIGTERM; `clean_leftovers()` removes what a killed run left behind.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from overcast.aggregator.launch import (
    AggregatorProcess,
    AggregatorStartError,
    start_aggregator,
    stop_aggregator,
)
from overcast.cluster.launch import Placement, compute_threads, run_ranks
from overcast.errors import OvercastError
from overcast.limits import check_aggregators, check_hosts, check_link_rate, check_mtu, require
from overcast.transport.datagram import reduction_batch
from overcast.wire.registration import DEFAULT_AGGREGATOR_PORT

PREFIX = "oc-"
RUN_DIR = "/run/overcast"
MULTICAST_NET = "239.0.0.0/8"
MAX_AGGREGATORS = 200  # 198.18.255.1 up to .200: below the querier's
QUERIER_ADDR = "198.18.255.254"  # the bridge's own, for its IGMP queries
QUERY_RESPONSE_SECONDS = 0.5
MASTER_PORT = 29500
# linux/sockios.h, linux/ethtool.h, linux/sched.h
_SIOCETHTOOL = 0x8946
_ETHTOOL_GGRO, _ETHTOOL_SGRO = 0x2B, 0x2C
_CLONE_NEWNET = 0x40000000


class ClusterError(OvercastError):
    """The emulated cluster could not be built; the message says why and what to do."""


def host_address(i: int) -> str:
    """Host i's address in 198.18.0.0/16 (198.18.255.0/24 is kept for the service)."""
    n = i + 1
    if n >= 255 * 256:
        raise ClusterError("at most 65279 hosts")
    return f"198.18.{n >> 8}.{n & 255}"


def aggregator_address(a: int) -> str:
    """Aggregator attachment a's address (the first is the service's)."""
    return f"198.18.255.{a + 1}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


def interface_gro(ns: str, ifname: str, on: bool | None = None) -> bool:
    """Whether GRO is on for `ifname` in network namespace `ns`, after turning it on or off
    (`on`: None leaves it): the ethtool ioctl, from a thread that enters the namespace and
    ends there."""
    said: dict[str, Any] = {}

    def in_namespace() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns}")
            finally:
                os.close(fd)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                for cmd in ([] if on is None else [_ETHTOOL_SGRO]) + [_ETHTOOL_GGRO]:
                    value = ctypes.create_string_buffer(struct.pack("=II", cmd, int(bool(on))))
                    ifreq = struct.pack("16sP16x", ifname.encode(), ctypes.addressof(value))
                    fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifreq)
                said["on"] = struct.unpack_from("=II", value.raw)[1] != 0
        except OSError as err:
            said["error"] = err

    thread = threading.Thread(target=in_namespace, name=f"overcast-gro-{ns}")
    thread.start()
    thread.join()
    if "error" in said:
        raise ClusterError(f"cannot reach GRO on {ifname} in {ns}: {said['error']}")
    return said["on"]


def check_privileges() -> None:
    """Raise ClusterError with a remedy unless this process may create network namespaces."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(
            f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)"
        )
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster creates network namespaces, veth links and tc qdiscs, which "
            "needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN). Run as root (sudo -E env "
            "PATH=$PATH overcast ...), or, where the kernel allows unprivileged user "
            "namespaces, inside one: unshare --user --map-root-user --net --mount sh -c "
            "'mount -t tmpfs none /run && python your_script.py' (the overcast command does "
            "this by itself when it is not root)"
        )


def _tbf(rate_bits: int, mtu: int, queue_bytes: int) -> list[str]:
    """tbf arguments: a bucket of 1 ms at line rate, never less than the largest paced batch of
    datagrams (transport.datagram.reduction_batch) and one frame more, and a queue. A NIC sends
    a batch back to back at its line rate, and the receiver's GRO takes it in whole; tbf cuts a
    batch larger than its bucket into single packets, which the receiver then reads one by
    one."""
    frame = mtu + 14
    burst = max((reduction_batch(rate_bits / 8, frame) + 1) * frame, rate_bits // 8 // 1000)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(queue_bytes)]


def run_owner(name: str) -> int | None:
    """The pid of the process that made the run namespace `name` belongs to, as its run file
    says; None where none is on record."""
    try:
        with open(os.path.join(RUN_DIR, run_of(name))) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run_of(name: str) -> str:
    """The run id of emulated-cluster namespace `name` (oc-<run>-<part>)."""
    return name[len(PREFIX) :].split("-")[0]


def _owner_alive(name: str) -> bool:
    pid = run_owner(name)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def list_namespaces() -> list[str]:
    out = _ip("-j", "netns", "list", check=False).stdout.strip()
    names = [entry["name"] for entry in json.loads(out)] if out else []
    return [n for n in names if n.startswith(PREFIX)]


def _kill_namespace_processes(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def clean_leftovers(force: bool = False) -> list[str]:
    """Remove namespaces of runs whose owning process is gone (all overcast ones if force)."""
    removed = []
    for name in list_namespaces():
        run_id = run_of(name)
        if force or not _owner_alive(name):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
            try:
                os.unlink(os.path.join(RUN_DIR, run_id))
            except OSError:
                pass
    return removed


@dataclass
class NicCounters:
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: NicCounters) -> NicCounters:
        return NicCounters(
            self.tx_bytes - other.tx_bytes,
            self.rx_bytes - other.rx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_packets - other.rx_packets,
        )


def read_nic_counters(ifname: str = "eth0") -> NicCounters:
    """This process's network namespace's counters for `ifname`, from /proc/self/net/dev."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                v = [int(x) for x in rest.split()]
                return NicCounters(tx_bytes=v[8], rx_bytes=v[0], tx_packets=v[9], rx_packets=v[1])
    raise ClusterError(f"no interface {ifname} in this network namespace")


class Cluster:
    """P shaped hosts and a switch. Use as a context manager; `run` calls a function per host."""

    def __init__(
        self,
        hosts: int,
        link_bits_per_s: int,
        *,
        mtu: int = 9000,
        switch_queue_bytes: int = 512 * 1024,
        aggregators: int = 1,
        aggregator_bits_per_s: int | None = None,
        service: bool = True,
        drop_multicast: Sequence[int] = (),
        gro: bool = True,
    ):
        check_hosts(hosts, least=1)
        for i in drop_multicast:
            require(
                isinstance(i, int) and 0 <= i < hosts,
                "a host whose multicast is dropped",
                f"a host number from 0 to {hosts - 1}",
                i,
                "--drop-multicast, drop_multicast",
            )
        check_link_rate(link_bits_per_s)
        check_mtu(mtu)
        check_aggregators(aggregators, MAX_AGGREGATORS)
        if aggregator_bits_per_s is not None:
            check_link_rate(
                aggregator_bits_per_s, "--aggregator-link-mbit, aggregator_bits_per_s / 1e6"
            )
        self.hosts, self.link_bits_per_s, self.mtu = hosts, link_bits_per_s, mtu
        self.switch_queue_bytes = switch_queue_bytes
        self.aggregators, self.aggregator_bits_per_s = aggregators, aggregator_bits_per_s
        self.service = service
        self.gro = gro  # on the hosts' and the aggregators' eth0, as on a NIC
        self.drop_multicast = sorted(set(drop_multicast))
        self.run_id = secrets.token_hex(3)
        self.secret = secrets.token_hex(32)
        self.switch_ns = f"{PREFIX}{self.run_id}-sw"
        self.host_ns = [f"{PREFIX}{self.run_id}-h{i}" for i in range(hosts)]
        self.service_ns = f"{PREFIX}{self.run_id}-svc"
        self.aggregator_ns = [self.service_ns] + [
            f"{PREFIX}{self.run_id}-svc{a}" for a in range(1, aggregators)
        ]
        self._created: list[str] = []
        self._aggregator_addresses: dict[int, str] = {}  # attachment -> its "host:port"
        self._procs: list[subprocess.Popen] = []
        self._old_sigterm: Callable[[int, FrameType | None], Any] | int | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)

    def up(self) -> None:
        check_privileges()
        os.makedirs(RUN_DIR, exist_ok=True)
        with open(os.path.join(RUN_DIR, self.run_id), "w") as f:
            f.write(f"{os.getpid()}\n")
        self._netns(self.switch_ns)
        sw = ["-n", self.switch_ns]
        # IGMP snooping, as a real switch does it: multicast goes only to the ports whose hosts
        # joined the group (not the aggregator's). The bridge is the querier, from an address
        # of its own, so that memberships are refreshed and never age out in a long run.
        # The bridge floods until its querier has waited one response interval (the kernel
        # shows no state for it), so the interval is short and up() waits it out at the end.
        # IGMPv3, so that no host holds back its report on hearing another's.
        centis = str(round(QUERY_RESPONSE_SECONDS * 100))
        _ip(
            *sw,
            "link",
            "add",
            "br0",
            "mtu",
            str(self.mtu),
            "type",
            "bridge",
            "mcast_snooping",
            "1",
            "mcast_igmp_version",
            "3",
            "mcast_query_response_interval",
            centis,
            "mcast_startup_query_interval",
            centis,
        )
        _ip(*sw, "link", "set", "br0", "type", "bridge", "mcast_querier", "1")
        snooping_from = time.monotonic() + QUERY_RESPONSE_SECONDS
        _ip(*sw, "addr", "add", f"{QUERIER_ADDR}/16", "dev", "br0")
        _ip(*sw, "link", "set", "br0", "up")
        _ip(*sw, "link", "set", "lo", "up")
        rate = self.link_bits_per_s
        for i, ns in enumerate(self.host_ns):
            self._attach(ns, f"h{i}", host_address(i), rate, rate)
        if self.service:
            shaped = self.aggregator_bits_per_s
            for a, ns in enumerate(self.aggregator_ns):
                self._attach(ns, f"svc{a or ''}", aggregator_address(a), shaped, shaped)
        for i in self.drop_multicast:
            self._drop_multicast(i)
        time.sleep(max(0.0, snooping_from - time.monotonic()))

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def _attach(
        self, ns: str, port: str, address: str, send_bits: int | None, recv_bits: int | None
    ) -> None:
        """A namespace with eth0 at `address`, cabled to switch port `port`."""
        self._netns(ns)
        mtu = str(self.mtu)
        _ip(
            "link",
            "add",
            "eth0",
            "netns",
            ns,
            "mtu",
            mtu,
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            self.switch_ns,
            "mtu",
            mtu,
        )
        _ip("-n", self.switch_ns, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/16", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if self.gro and not interface_gro(ns, "eth0", True):
            raise ClusterError(f"GRO stays off on eth0 in {ns} (this kernel's veth has none?)")
        _ip("-n", ns, "route", "add", MULTICAST_NET, "dev", "eth0")
        # A collective follows a pause; TCP must not fall back to slow start after each one.
        subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"],
            check=True,
            capture_output=True,
        )
        # The sender's own queue is deep, so a sender blocks on its socket rather than losing
        # datagrams in its own NIC; the switch port's queue is a switch buffer.
        if send_bits:
            _tc(
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                *_tbf(send_bits, self.mtu, 8 * 1024 * 1024),
            )
        if recv_bits:
            _tc(
                "-n",
                self.switch_ns,
                "qdisc",
                "add",
                "dev",
                port,
                "root",
                *_tbf(recv_bits, self.mtu, self.switch_queue_bytes),
            )

    def _drop_multicast(self, i: int) -> None:
        """The switch drops every multicast datagram (UDP to 239.0.0.0/8) it would send to host
        `i`: its port's queue becomes an HTB whose default class holds the shaping as before and
        whose other class drops all (a FIFO of no packets: this kernel's tc has no drop
        action), with a u32 filter sending multicast there."""
        sw, port = ("-n", self.switch_ns), f"h{i}"
        _tc(*sw, "qdisc", "del", "dev", port, "root")
        _tc(*sw, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "1")
        for band in ("1:1", "1:2"):  # HTB's own rate far above the link's: it only sorts
            _tc(
                *sw,
                "class",
                "add",
                "dev",
                port,
                "parent",
                "1:",
                "classid",
                band,
                "htb",
                "rate",
                "100gbit",
            )
        _tc(
            *sw,
            "qdisc",
            "add",
            "dev",
            port,
            "parent",
            "1:1",
            *_tbf(self.link_bits_per_s, self.mtu, self.switch_queue_bytes),
        )
        _tc(*sw, "qdisc", "add", "dev", port, "parent", "1:2", "pfifo", "limit", "0")
        _tc(
            *sw,
            "filter",
            "add",
            "dev",
            port,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "ip",
            "dst",
            MULTICAST_NET,
            "match",
            "ip",
            "protocol",
            "17",
            "0xff",
            "flowid",
            "1:2",
        )

    def multicast_dropped(self, host: int) -> int:
        """Multicast datagrams the switch has dropped on their way to `host` (one of
        `drop_multicast`)."""
        out = subprocess.run(
            ["tc", "-n", self.switch_ns, "-s", "-j", "qdisc", "show", "dev", f"h{host}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return sum(q.get("drops", 0) for q in json.loads(out) if q["kind"] == "pfifo")

    def down(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._procs.clear()
        for name in reversed(self._created):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
        self._created.clear()
        try:
            os.unlink(os.path.join(RUN_DIR, self.run_id))
        except OSError:
            pass

    # -- using it --------------------------------------------------------------------------
    @property
    def master_addr(self) -> str:
        return host_address(0)

    def environment(self, rank: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """torchrun-style variables for host `rank` (a share of the cores for its compute
        threads among them), plus the job secret and link rate."""
        return {
            **compute_threads(self.hosts),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.hosts),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(MASTER_PORT),
            "OVERCAST_SECRET": self.secret,
            "OVERCAST_LINK_BITS_PER_S": str(self.link_bits_per_s),
            "GLOO_SOCKET_IFNAME": "eth0",
            **(
                {"OVERCAST_AGGREGATORS": self.aggregator_addresses}
                if self.aggregator_addresses
                else {}
            ),
            **(extra or {}),
        }

    def placements(self, extra: dict[str, str] | None = None) -> list[Placement]:
        return [Placement(ns, self.environment(r, extra)) for r, ns in enumerate(self.host_ns)]

    def run(self, fn, args=(), timeout: float = 600.0, env: dict[str, str] | None = None):
        """fn(rank, *args) on every host at once; the results in rank order (see run_ranks)."""
        return run_ranks(fn, self.placements(env), args, timeout)

    def start(
        self, argv: list[str], host: int | None = None, env: dict[str, str] | None = None, **popen
    ) -> subprocess.Popen:
        """Start a command on host `host`, or on the service attachment if None; it is killed
        at teardown if still running."""
        ns = self.service_ns if host is None else self.host_ns[host]
        full_env = {**os.environ, **self.environment(0 if host is None else host, env)}
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=full_env, **popen)
        self._procs.append(proc)
        return proc

    @property
    def aggregator_addresses(self) -> str | None:
        """OVERCAST_AGGREGATORS for the aggregators running: in the order of their attachments."""
        return (
            ",".join(self._aggregator_addresses[a] for a in sorted(self._aggregator_addresses))
            or None
        )

    def start_aggregator(
        self,
        slots: int = 256,
        stats_path: str | None = None,
        port: int = DEFAULT_AGGREGATOR_PORT,
        secrets: list[str] | None = None,
        aggregator: int = 0,
        shards: int | None = None,
    ) -> AggregatorProcess:
        """Start an aggregator (overcast aggregator, `shards` data-path threads, None: the cores it
        may use) on attachment `aggregator`; from then on the hosts' environment points at it
        (with the others). It serves this cluster's job, or the jobs whose secrets (hex) are
        given. Returns once it listens."""
        try:
            proc, address = start_aggregator(
                aggregator_address(aggregator),
                port,
                secrets=secrets or [self.secret],
                slots=slots,
                stats_path=stats_path,
                shards=shards,
                prefix=("ip", "netns", "exec", self.aggregator_ns[aggregator]),
            )
        except AggregatorStartError as err:
            raise ClusterError(str(err)) from None
        self._procs.append(proc)
        proc.aggregator = aggregator
        self._aggregator_addresses[aggregator] = address
        return proc

    def start_aggregators(
        self, slots: int = 256, stats_dir: str | None = None, shards: int | None = None
    ) -> list[AggregatorProcess]:
        """An aggregator on every attachment (`aggregators`), each writing its stats to
        stats_dir/aggregator-<a>.json."""
        return [
            self.start_aggregator(
                slots,
                stats_dir and os.path.join(stats_dir, f"aggregator-{a}.json"),
                aggregator=a,
                shards=shards,
            )
            for a in range(self.aggregators)
        ]

    def stop_aggregator(self, proc: AggregatorProcess) -> None:
        """Stop an aggregator gracefully (it writes its stats file on the way out)."""
        stop_aggregator(proc)
        self._aggregator_addresses.pop(proc.aggregator, None)

    def stop_aggregators(self, procs: list[AggregatorProcess], stats_dir: str) -> list[dict]:
        """Stop the aggregators start_aggregators started; their reports, in order."""
        reports = []
        for a, proc in enumerate(procs):
            self.stop_aggregator(proc)
            with open(os.path.join(stats_dir, f"aggregator-{a}.json")) as f:
                reports.append(json.load(f))
        return reports

    def counters(self, host: int | None, aggregator: int = 0) -> NicCounters:
        """Host `host`'s eth0 counters (None: aggregator attachment `aggregator`'s), read from
        outside its namespace."""
        ns = self.aggregator_ns[aggregator] if host is None else self.host_ns[host]
        out = _ip("-n", ns, "-s", "-j", "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return NicCounters(
            stats["tx"]["bytes"],
            stats["rx"]["bytes"],
            stats["tx"]["packets"],
            stats["rx"]["packets"],
        )


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)
