"""The emulated cluster: built as described, shaped per direction, counted, cleaned up always."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import overcast
from conftest import root_only
from overcast.cluster.netns import Cluster, interface_gro, list_namespaces, read_nic_counters
from overcast.transport.datagram import reduction_batch

pytestmark = root_only
CLI = [sys.executable, "-m", "overcast.cli.main"]


def describe_host(rank):
    with open("/proc/self/net/dev") as f:
        names = sorted(line.split(":")[0].strip() for line in f if ":" in line)
    return {"rank": rank, "env": {k: os.environ[k] for k in
                                  ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
            "interfaces": names}


def qdisc(ns, dev):
    out = subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)[0]


def test_hosts_links_shaping_and_environment():
    with Cluster(3, 100_000_000) as cluster:
        names = {cluster.switch_ns, cluster.service_ns, *cluster.host_ns}
        assert names <= set(list_namespaces())
        info = cluster.run(describe_host)
        for rank, host in enumerate(info):
            assert host["env"] == {"RANK": str(rank), "WORLD_SIZE": "3",
                                   "MASTER_ADDR": "198.18.0.1", "MASTER_PORT": "29500"}
            assert host["interfaces"] == ["eth0", "lo"]
            ns = cluster.host_ns[rank]
            link = json.loads(subprocess.run(["ip", "-n", ns, "-j", "addr", "show", "eth0"],
                                             capture_output=True, text=True).stdout)[0]
            assert link["mtu"] == 9000
            assert link["addr_info"][0]["local"] == f"198.18.0.{rank + 1}"
            routes = subprocess.run(["ip", "-n", ns, "route", "show", "239.0.0.0/8"],
                                    capture_output=True, text=True).stdout
            assert "dev eth0" in routes
            # shaped on both ends: the host's send direction and the switch port toward it
            for q in (qdisc(ns, "eth0"), qdisc(cluster.switch_ns, f"h{rank}")):
                assert q["kind"] == "tbf" and q["options"]["rate"] == 12_500_000
                # the bucket takes the largest paced batch whole, and about a frame more (tc
                # rounds it)
                batch = reduction_batch(12_500_000, 9014)
                assert q["options"]["burst"] >= 0.99 * (batch + 1) * 9014
        # the service attachment is the switch's fabric: not shaped by default
        assert qdisc(cluster.service_ns, "eth0")["kind"] != "tbf"
    assert not names & set(list_namespaces())


def blast(rank, nbytes, both):
    """Host 0 sends `nbytes` over TCP to host 1 (and back at once if `both`); returns the
    seconds it took and the NIC counters' deltas."""
    before = read_nic_counters()
    peer = "198.18.0.2" if rank == 0 else "198.18.0.1"
    if rank == 1:
        server = socket.create_server(("198.18.0.2", 5001))
    overcast.Communicator(timeout=30).close()  # a rendezvous: the server is listening now
    if rank == 0:
        conn = socket.create_connection((peer, 5001))
    else:
        conn, _ = server.accept()
    t0 = time.monotonic()
    sender = rank == 0 or both
    data = bytes(nbytes)
    if sender:
        import threading
        t = threading.Thread(target=conn.sendall, args=(data,))
        t.start()
    got = 0
    if rank == 1 or both:
        while got < nbytes:
            got += len(conn.recv(1 << 20))
    if sender:
        t.join()
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the peer's close: everything arrived
    elapsed = time.monotonic() - t0
    conn.close()
    delta = read_nic_counters() - before
    return [elapsed, delta.tx_bytes, delta.rx_bytes]


def test_the_nics_have_gro_on_and_the_switch_ports_do_not():
    """GRO on every host's and aggregator's eth0, as on a NIC (a veth's is off by default); the
    switch's ports left as they are; and turned off and on again as asked."""
    with Cluster(2, 100_000_000, aggregators=2) as cluster:
        for ns in [*cluster.host_ns, *cluster.aggregator_ns]:
            assert interface_gro(ns, "eth0")
        assert not any(interface_gro(cluster.switch_ns, port) for port in ("h0", "h1", "svc"))
        assert not interface_gro(cluster.host_ns[0], "eth0", False)
        assert interface_gro(cluster.host_ns[0], "eth0", True)
    with Cluster(1, 100_000_000, gro=False, service=False) as cluster:
        assert not interface_gro(cluster.host_ns[0], "eth0")


def aggregators_seen(rank):
    from overcast.limits import aggregators_from_env
    return aggregators_from_env()


def test_an_old_aggregators_variable_left_in_the_shell_does_not_reach_the_ranks(monkeypatch):
    """OVERCAST_SWITCH (the old name) exported in the caller's shell, naming elsewhere: the
    cluster's own aggregators are what every rank reads, without a contradiction."""
    monkeypatch.setenv("OVERCAST_SWITCH", "198.18.99.1:18515")
    monkeypatch.delenv("OVERCAST_AGGREGATORS", raising=False)
    with Cluster(2, 100_000_000) as cluster:
        aggregators = cluster.start_aggregators()
        started = cluster.aggregator_addresses
        try:
            seen = cluster.run(aggregators_seen)
        finally:
            for proc in aggregators:
                cluster.stop_aggregator(proc)
    assert started and seen == [started] * 2


@pytest.mark.parametrize("both", [False, True])
def test_rate_is_enforced_per_direction_and_counted(both):
    nbytes, rate = 3_000_000, 100_000_000
    with Cluster(2, rate) as cluster:
        before = cluster.counters(0)
        (t0, tx0, rx0), (t1, tx1, rx1) = cluster.run(blast, args=(nbytes, both))
        outside = cluster.counters(0) - before
    # the counters read from outside the namespace see what the host read from inside
    assert outside.tx_bytes >= tx0 >= nbytes and outside.tx_packets > 0
    floor = nbytes * 8 / rate
    # Never faster than the shaper allows, in each direction, even with both sending at once
    # (full duplex: one direction does not take the other's rate).
    assert t0 >= 0.9 * floor and t1 >= 0.9 * floor
    assert tx0 >= nbytes and rx1 >= nbytes
    if both:
        assert tx1 >= nbytes and rx0 >= nbytes
        assert max(t0, t1) < 3 * floor  # full duplex, with a wide margin for a loaded CPU
    else:
        assert tx1 < nbytes * 0.05  # only acknowledgements went back


def test_two_clusters_at_once_do_not_collide():
    with Cluster(2, 100_000_000) as a, Cluster(2, 100_000_000) as b:
        assert a.run_id != b.run_id
        assert not set(a.host_ns) & set(b.host_ns)
        assert [h["rank"] for h in a.run(describe_host)] == [0, 1]
        assert [h["rank"] for h in b.run(describe_host)] == [0, 1]


def test_torn_down_after_an_error_inside():
    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(2, 100_000_000) as cluster:
            names = set(cluster.host_ns)
            raise RuntimeError("boom")
    assert not names & set(list_namespaces())


def cross_host(rank):
    with overcast.Communicator(timeout=30) as comm:
        world = comm.world_size
        out = np.empty(world * 100_003, np.int32)
        comm.all_gather(out, np.full(100_003, rank, np.int32))
        rs_out = np.empty(50_001, np.float64)
        comm.reduce_scatter(rs_out, np.full(world * 50_001, rank + 1.0))
        return [bool((out.reshape(world, -1) == np.arange(world)[:, None]).all()),
                bool((rs_out == world * (world + 1) / 2).all()), comm.address]


def test_ring_collectives_across_namespaces():
    with Cluster(3, 200_000_000) as cluster:
        results = cluster.run(cross_host, timeout=120)
    assert results == [[True, True, f"198.18.0.{r + 1}"] for r in range(3)]


def start_cluster_cli(hosts=2):
    # as from a terminal: a suite started in the background (`pytest &`) ignores SIGINT, and
    # Python keeps an ignored SIGINT ignored, as a background job should be
    proc = subprocess.Popen([*CLI, "cluster", "up", "--hosts", str(hosts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = proc.stdout.readline()  # printed once the cluster is up
    assert line.startswith("cluster "), line + proc.stderr.read()
    run_id = line.split()[1].rstrip(":")
    assert any(run_id in n for n in list_namespaces())
    return proc, run_id


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_and_terminate_tear_the_cluster_down(sig):
    proc, run_id = start_cluster_cli()
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert not any(run_id in n for n in list_namespaces())


def test_the_suite_answers_for_its_own_namespaces_and_those_of_the_dead_alone():
    """The end-of-suite check counts a namespace made by this process (or a child), or by one
    that is gone; a live run of another process (pid 1 stands for one) is not its business."""
    from conftest import made_here
    from overcast.cluster.netns import PREFIX, RUN_DIR

    with Cluster(1, 100_000_000, service=False) as cluster:
        assert made_here(cluster.host_ns[0])
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    for run_id, pid, ours in (("c0ffee", 1, False), ("dead01", gone.pid, True)):
        path = os.path.join(RUN_DIR, run_id)
        with open(path, "w") as f:
            f.write(f"{pid}\n")
        try:
            assert made_here(f"{PREFIX}{run_id}-h0") is ours
        finally:
            os.unlink(path)
    assert made_here(f"{PREFIX}nofile-h0")


def test_clean_removes_what_a_killed_run_left_and_spares_live_runs():
    proc, dead = start_cluster_cli()
    proc.kill()
    proc.wait()
    assert any(dead in n for n in list_namespaces())
    with Cluster(2, 100_000_000) as live:
        out = subprocess.run([*CLI, "cluster", "clean"], capture_output=True, text=True,
                             check=True).stdout
        assert dead in out
        names = list_namespaces()
        assert not any(dead in n for n in names)
        assert set(live.host_ns) <= set(names)


def test_cluster_run_runs_a_command_on_every_host():
    out = subprocess.run([*CLI, "cluster", "run", "--hosts", "3", "--", "sh", "-c",
                          "echo host $RANK of $WORLD_SIZE master $MASTER_ADDR"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    # each host's output under its rank: the prefix and the rank it was given agree
    assert sorted(out.strip().split("\n")) == [f"[rank {r}] host {r} of 3 master 198.18.0.1"
                                              for r in range(3)]


@pytest.mark.parametrize("users", [None, "3"])
def test_cluster_run_shares_the_cores_among_the_hosts_compute_threads(users):
    """As torchrun: OMP_NUM_THREADS, where the user has not set it, is the cores divided among
    the hosts (at least 1), said once on stderr; the user's own stands, unsaid."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if users:
        env["OMP_NUM_THREADS"] = users
    hosts = 3
    run = subprocess.run([*CLI, "cluster", "run", "--hosts", str(hosts), "--", sys.executable,
                          "-c", "import os, torch; print(os.environ['OMP_NUM_THREADS'], "
                                "torch.get_num_threads())"],
                         capture_output=True, text=True, check=True, timeout=120, env=env)
    threads = users or str(max(1, len(os.sched_getaffinity(0)) // hosts))
    seen = [line.split()[2:] for line in run.stdout.splitlines()]  # after "[rank N]"
    assert [env for env, _ in seen] == [threads] * hosts, run.stdout
    if not users:  # torch read it (it caps a user's number at the cores it finds)
        assert [torch_threads for _, torch_threads in seen] == [threads] * hosts, run.stdout
    said = [line for line in run.stderr.splitlines() if "OMP_NUM_THREADS" in line]
    assert said == ([] if users else [f"overcast: OMP_NUM_THREADS={threads} for each of {hosts} "
                                      f"ranks sharing {len(os.sched_getaffinity(0))} cores (set "
                                      f"OMP_NUM_THREADS to choose)"]), run.stderr


def test_the_cluster_runs_inside_a_user_namespace_of_its_own():
    """What the command does when it is not root: the whole cluster inside a fresh user,
    network and mount namespace, leaving nothing in the machine's own /run/netns."""
    from overcast.cluster import userns
    before = set(list_namespaces())
    argv = userns.command(["-m", "overcast.cli.main", "cluster", "run", "--hosts", "2", "--",
                           "sh", "-c", "echo $RANK $(ip -br -4 addr show eth0)"])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    assert sorted(line.split()[2] + " " + line.split()[-1] for line in out.strip().split("\n")) \
        == ["0 198.18.0.1/16", "1 198.18.0.2/16"]  # after "[rank N]"
    assert set(list_namespaces()) == before


def test_without_privilege_it_says_what_to_do():
    code = ("from overcast.cluster.netns import Cluster\n"
            "Cluster(2, 10**8).__enter__()\n")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode != 0
    assert "ClusterError" in out.stderr and "needs root" in out.stderr
    assert "unshare --user --map-root-user" in out.stderr


def gather_mib(rank):
    with overcast.Communicator(name="snoop", timeout=60) as comm:
        out = np.empty(comm.world_size << 20, np.uint8)
        comm.all_gather(out, np.full(1 << 20, rank, np.uint8), algorithm="multicast")
        comm.barrier()
        return bool(all((out[r << 20:(r + 1) << 20] == r).all() for r in range(comm.world_size)))


def test_the_switch_forwards_multicast_only_to_ports_that_joined():
    """IGMP snooping: the hosts' multicast AllGather (3 MiB out in all) reaches every host, and
    not the aggregator's attachment, which never joined the group."""
    with Cluster(3, 1_000_000_000) as cluster:
        before = [cluster.counters(h) for h in (0, 1, 2, None)]
        assert cluster.run(gather_mib, timeout=120) == [True] * 3
        after = [cluster.counters(h) for h in (0, 1, 2, None)]
    received = [a.rx_bytes - b.rx_bytes for a, b in zip(after, before)]
    assert all(r > 2 << 20 for r in received[:3])
    assert received[3] < 64 << 10  # queries and neighbour discovery, not 3 MiB of shards
