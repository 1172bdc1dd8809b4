"""In-network ReduceScatter and the aggregator, sans I/O: exact integer sums, float sums within
tolerance and the same bits whatever the delivery order, under loss, duplicates and reordering;
the pool bounds the aggregator's memory; communicators sharing it stay apart."""

import numpy as np
import pytest

from fabric import Fabric
from overcast.buffers import BFLOAT16, dtype_code
from overcast.errors import CollectiveTimeoutError
from overcast.protocols.base import Descriptor
from overcast.protocols.budget import LinkBudget
from overcast.protocols.innetwork import InNetworkReduceScatter
from overcast.aggregator.reduction import MAX_RESEND_SECONDS, RESEND_SECONDS, Aggregator
from overcast.wire.header import AGGREGATOR, Header, Kind
from overcast.wire.messages import pack_acks, pack_contribution_prefix

CHUNK = 64
RATE = 1e6


def reduce_scatter(fabric, count, dtype, op="sum", slots=16, inputs=None, seq=0):
    world = fabric.world
    rng = np.random.default_rng(count + world)
    if inputs is None:
        if np.dtype(dtype).kind == "f":
            inputs = [rng.standard_normal(world * count).astype(dtype) for _ in range(world)]
        else:
            inputs = [rng.integers(-1000, 1000, world * count).astype(dtype)
                      for _ in range(world)]
    outs = [np.full(count, -1).astype(dtype) for _ in range(world)]
    colls = []
    for r in range(world):
        desc = Descriptor("reduce_scatter", "innetwork", np.dtype(dtype), count, op)
        coll = InNetworkReduceScatter(seq, r, world, desc, outs[r], inputs[r],
                                      chunk_bytes=CHUNK, slots=slots,
                                      budget=LinkBudget(RATE, batch=fabric.runs),
                                      stripes=max(len(fabric.aggregators), 1))
        colls.append(coll)
        fabric.post(r, coll)
    return colls, outs, inputs


def check_done(colls):
    for c in colls:
        assert c.error is None, c.error
        assert c.done, c.waiting_for()


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("loss,burst", [(0.0, 1), (0.01, 1), (0.10, 1), (0.05, 8)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("runs", [1, 4])
def test_integer_sums_are_exact_under_loss(world, loss, burst, dtype, runs):
    agg = Aggregator(slots=16)
    fabric = Fabric(world, seed=world, loss=loss, burst=burst, duplicate=0.02, reorder=True,
                    aggregator=agg, runs=runs)
    count = 300 + world
    colls, outs, inputs = reduce_scatter(fabric, count, dtype)
    fabric.run_timed()
    check_done(colls)
    total = sum(inputs)
    for r in range(world):
        assert outs[r].tobytes() == total[r * count:(r + 1) * count].tobytes()
    if loss:
        assert fabric.dropped > 0
    if loss >= 0.05:  # enough loss that contributions and results, not just credit, were hit
        assert agg.stats["nacks"] + agg.stats["results_resent"] + \
            agg.stats["results_resent_early"] > 0


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_integer_averages_truncate_toward_zero(world, dtype):
    """The owner divides its block's sum natively as NCCL averages integers: truncated toward
    zero, negative sums and positive, even and not."""
    from test_session import truncated_averages
    count = 50
    low = 0 if np.dtype(dtype).kind == "u" else -20
    inputs = [((np.arange(world * count) * 7 + r * 5) % 41 + low).astype(dtype)
              for r in range(world)]
    fabric = Fabric(world, seed=world, aggregator=Aggregator(slots=16))
    colls, outs, _ = reduce_scatter(fabric, count, dtype, op="avg", inputs=inputs)
    fabric.run_timed()
    check_done(colls)
    expect = truncated_averages(inputs, world)
    if low:
        assert (expect < 0).any() and (expect > 0).any() and (expect * world != sum(
            i.astype(np.int64) for i in inputs)).any()
    for r in range(world):
        assert outs[r].tolist() == expect[r * count:(r + 1) * count].tolist()


def test_acknowledgements_and_credit_ride_at_the_end_of_a_batch():
    """A rank's acknowledgements leave as the last datagram of its next batch of contributions,
    and the aggregator's credit to an owner as the last of each batch of results to it: the
    engine seals a route's messages back to back, so neither costs a send or a read of its own."""
    world = 4
    agg = Aggregator(slots=16)
    fabric = Fabric(world, seed=1, aggregator=agg, runs=4)
    colls, outs, inputs = reduce_scatter(fabric, 300, np.int32)
    fabric.run_timed()
    check_done(colls)
    sent = [(h.src, h.dst, h.kind) for h, _, datagram in fabric.seen if datagram]
    for r in range(world):
        kinds = [kind for src, _, kind in sent if src == r]
        last_contribution = max(i for i, kind in enumerate(kinds) if kind == Kind.CONTRIB)
        riding = [kinds[i - 1] for i, kind in enumerate(kinds[:last_contribution])
                  if kind == Kind.RESULT_ACK]
        assert riding and set(riding) == {Kind.CONTRIB}
    for owner in range(world):
        kinds = [kind for src, dst, kind in sent if src == AGGREGATOR and dst == owner]
        ends = [i for i, kind in enumerate(kinds)
                if kind == Kind.RESULT and (i + 1 == len(kinds) or kinds[i + 1] != Kind.RESULT)]
        assert ends and all(i + 1 < len(kinds) and kinds[i + 1] == Kind.CREDIT for i in ends)


def two_rank_aggregator():
    """An aggregator of a 2-rank communicator, 8 chunks in groups of 1 (rank 1 owns odd
    chunks), and what completes chunk g (rank 0's contribution) and acknowledges results."""
    agg = Aggregator(slots=8)
    agg.register("comm", 2)

    def contribute(g, now):
        payload = pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, 2, 8) + \
            np.full(4, g, np.int32).tobytes()
        agg.receive("comm", Header(Kind.CONTRIB, 0, 0, 0, 0, AGGREGATOR, g, len(payload), 0),
                    memoryview(payload), now)

    def acknowledge(chunks, now, src=1):
        payload = pack_acks(chunks)
        agg.receive("comm", Header(Kind.RESULT_ACK, 0, 0, 0, src, AGGREGATOR, len(chunks),
                                   len(payload), 0), memoryview(payload), now)

    return agg, contribute, acknowledge


def results_sent(agg):
    return [(dst, msg.chunk) for _, dst, msg in agg.outbox if msg.kind == Kind.RESULT]


def test_results_are_sent_again_after_the_measured_round_trip_not_before():
    """Acknowledgements that come 80 ms after their results raise the resend timeout above
    80 ms (RFC 6298's estimator); a result is then not sent again at 60 ms, where the floor of
    50 ms would have sent it, but is once the timeout has passed. The estimate is the owner's:
    rank 0, whose round trips were not measured, keeps the floor."""
    agg, contribute, acknowledge = two_rank_aggregator()
    for g in (1, 3, 5):
        contribute(g, g / 10)
        acknowledge([g], g / 10 + 0.08)
    timeout = agg.resend_timeout("comm", 1)
    assert 0.08 < timeout < MAX_RESEND_SECONDS and timeout > 2 * RESEND_SECONDS
    assert agg.resend_timeout("comm", 0) == RESEND_SECONDS
    contribute(7, 1.0)
    agg.outbox.clear()
    agg.handle_timer(1.06)
    assert agg.stats["results_resent"] == 0
    agg.handle_timer(1.0 + timeout + 0.001)
    assert agg.stats["results_resent"] == 1
    assert results_sent(agg) == [(1, 7)]
    assert agg.stats["results_resent_early"] == 0  # every result was acknowledged in order


def test_a_result_its_owner_acknowledged_a_later_one_past_is_sent_again_at_once():
    """The path to an owner keeps order and the owner acknowledges every result it takes: an
    acknowledgement of result 5 and not 1 or 3, sent before it, says those were lost. They go
    again at once, not after the resend timeout. Evidence counts once per copy: an
    acknowledgement of a result sent twice proves nothing of the others (it may answer the
    first copy), nor does one from a rank that does not own the chunk."""
    agg, contribute, acknowledge = two_rank_aggregator()
    for g in (1, 3, 5):
        contribute(g, 0.0)
    contribute(7, 0.001)
    agg.outbox.clear()
    acknowledge([3], 0.002, src=0)  # not rank 0's to acknowledge: stray, no evidence
    assert results_sent(agg) == [] and agg.drops["stray_acks"] == 1
    acknowledge([5], 0.003)
    assert results_sent(agg) == [(1, 1), (1, 3)]
    assert agg.stats["results_resent_early"] == 2 and agg.stats["results_resent"] == 0
    agg.outbox.clear()
    acknowledge([1], 0.004)  # a copy sent twice: says nothing of result 3's second copy
    assert results_sent(agg) == []
    acknowledge([7], 0.005)  # sent once, after 3's first copy but before its second
    assert results_sent(agg) == []
    acknowledge([3], 0.006)
    assert agg.reductions("comm") == {0: 0}  # chunk 0 (rank 0's) has had no contribution
    assert agg.stats["results_resent_early"] == 2


@pytest.mark.parametrize("world", [2, 5, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BFLOAT16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_float_sums_match_float64_and_do_not_depend_on_arrival_order(world, dtype, op):
    results = []
    for seed in (1, 2):
        fabric = Fabric(world, seed=seed, loss=0.05, duplicate=0.05, reorder=True,
                        aggregator=Aggregator(slots=16))
        count = 250
        colls, outs, inputs = reduce_scatter(fabric, count, dtype, op)
        fabric.run_timed()
        check_done(colls)
        results.append(np.concatenate(outs))
    reference = sum(i.astype(np.float64) for i in inputs)
    if op == "avg":
        reference /= world
    eps = float(np.finfo(np.float32 if dtype == BFLOAT16 else dtype).eps) \
        if dtype != BFLOAT16 else 2.0 ** -8
    tolerance = 4 * world * eps * np.abs(sum(np.abs(i.astype(np.float64)) for i in inputs))
    assert (np.abs(results[0].astype(np.float64) - reference) <= tolerance + 1e-30).all()
    # the aggregator sums in rank order, whatever order the datagrams came in
    assert results[0].tobytes() == results[1].tobytes()
    if op == "sum":
        assert results[0].tobytes() == summed_in_rank_order(inputs, count, dtype).tobytes()


def summed_in_rank_order(inputs, count, dtype):
    """What each owner gets, as numpy computes it: the other ranks' shards added one by one in
    rank order (16-bit floats in float32, rounded once), then the owner's own added to that."""
    wide = np.float32 if np.dtype(dtype).itemsize == 2 else dtype
    outs = []
    for owner in range(len(inputs)):
        shards = [i[owner * count:(owner + 1) * count].astype(wide) for q, i in enumerate(inputs)
                  if q != owner]
        total = shards[0]
        for shard in shards[1:]:
            total = total + shard
        own = inputs[owner][owner * count:(owner + 1) * count].astype(wide)
        outs.append((total.astype(dtype).astype(wide) + own).astype(dtype))
    return np.concatenate(outs)


@pytest.mark.parametrize("stripes", [2, 3, 5])
@pytest.mark.parametrize("runs", [1, 4])
def test_striped_over_endpoints_the_sums_are_those_of_one_aggregator_bit_for_bit(stripes, runs):
    """Chunks striped over several aggregator endpoints (the shards of one aggregator or
    several), under loss, duplication and reordering: every endpoint takes only its stripe,
    each does its share, and the results are the bits one aggregator gives (collective 0's
    runs start on endpoint 0, collective 1's on endpoint 1)."""
    world, count = 5, 700
    rng = np.random.default_rng(stripes)
    inputs = [rng.standard_normal(world * count).astype(np.float32) for _ in range(world)]
    results = []
    for aggregators in ([Aggregator(slots=8)], [Aggregator(slots=8) for _ in range(stripes)]):
        fabric = Fabric(world, seed=stripes, loss=0.05, duplicate=0.02, reorder=True,
                        aggregator=aggregators, runs=runs)
        outs = []
        for seq in range(2):
            colls, out, _ = reduce_scatter(fabric, count, np.float32, slots=8, seq=seq,
                                           inputs=[i.copy() for i in inputs])
            fabric.run_timed()
            check_done(colls)
            outs += out
        results.append(np.concatenate(outs).tobytes())
        assert all(a.pool_bytes == 0 and not a.reductions("comm") for a in aggregators)
    assert results[0] == results[1]
    shares = [a.stats["contributions"] for a in aggregators]
    chunks = world * -(-count * 4 // CHUNK)
    assert sum(shares) >= chunks * (world - 1)  # every contribution, some twice
    assert min(shares) > 0.5 * max(shares), shares  # striped, not piled on one
    assert all(a.drops["misdirected"] == 0 for a in aggregators)


def test_the_pool_bounds_the_aggregator_for_a_message_larger_than_the_pool():
    world, slots = 4, 8
    agg = Aggregator(slots=slots)
    fabric = Fabric(world, seed=3, loss=0.02, reorder=True, aggregator=agg)
    count = 100 * CHUNK // 4  # 100 chunks per block, 400 in all: 50 times the pool
    colls, outs, inputs = reduce_scatter(fabric, count, np.int32, slots=slots)
    fabric.run_timed()
    check_done(colls)
    total = sum(inputs)
    assert all(outs[r].tobytes() == total[r * count:(r + 1) * count].tobytes()
               for r in range(world))
    message = world * count * 4
    assert agg.peak_pool_bytes <= (slots + 1) * world * CHUNK
    assert agg.peak_pool_bytes < message / 10
    assert agg.pool_bytes == 0 and not agg.reductions("comm")


def test_a_finished_reductions_pool_serves_the_next_and_goes_with_its_communicator():
    """The pool a communicator's finished reduction leaves is its own: kept for its next
    reduction, freed when it is unregistered, while another communicator stays registered
    (which may not hold it: it would lie outside both communicators' bounds)."""
    world, slots = 4, 8
    agg = Aggregator(slots=slots)
    agg.register("other", 2)
    fabric = Fabric(world, seed=5, loss=0.02, reorder=True, aggregator=agg)
    count = 20 * CHUNK // 4
    for seq in range(3):
        colls, outs, inputs = reduce_scatter(fabric, count, np.int32, slots=slots, seq=seq)
        fabric.run_timed()
        check_done(colls)
        total = sum(inputs)
        assert all(outs[r].tobytes() == total[r * count:(r + 1) * count].tobytes()
                   for r in range(world))
        assert agg.pool_bytes == 0 and agg.kept_pool_bytes == agg.peak_pool_bytes > 0
    assert agg.stats["pools_reused"] == 2 and agg.stats["reductions"] == 3
    agg.unregister("comm")
    assert agg.kept_pool_bytes == 0


def test_two_communicators_share_one_aggregator_and_stay_apart():
    agg = Aggregator(slots=8)
    a = Fabric(3, seed=1, loss=0.05, reorder=True, aggregator=agg, key="a")
    b = Fabric(5, seed=2, loss=0.05, reorder=True, aggregator=agg, key="b")
    ca, oa, ia = reduce_scatter(a, 200, np.int64)
    cb, ob, ib = reduce_scatter(b, 300, np.int64)
    for _ in range(100_000):  # interleave the two until both finish
        progressed = a.step() | b.step()
        if not progressed:
            if a.done() and b.done():
                break
            timers = [t for f in (a, b) for m in f._machines()
                      if (t := m.get_timer()) is not None]
            now = max(min(timers), a.now, b.now)
            a.now = b.now = now
            a._fire()
            b._fire()
    check_done(ca + cb)
    for outs, inputs, count in ((oa, ia, 200), (ob, ib, 300)):
        total = sum(inputs)
        for r, out in enumerate(outs):
            assert out.tobytes() == total[r * count:(r + 1) * count].tobytes()


def test_a_silent_aggregator_times_out_on_every_rank():
    fabric = Fabric(3, timeout=2.0, aggregator=Aggregator())
    fabric.silent.add(AGGREGATOR)
    colls, _, _ = reduce_scatter(fabric, 100, np.int32)
    fabric.run_timed(until=1.0)
    assert not any(c.error for c in colls)
    fabric.advance(2.5)
    for c in colls:
        assert isinstance(c.error, CollectiveTimeoutError)
        assert "aggregator" in str(c.error)


def test_each_rank_receives_only_its_shard():
    world = 4
    agg = Aggregator(slots=16)
    fabric = Fabric(world, aggregator=agg)
    count = 20 * CHUNK // 4
    colls, outs, inputs = reduce_scatter(fabric, count, np.int32)
    fabric.run_timed()
    check_done(colls)
    for c in colls:
        assert c.stats["results"] == 20  # one result per chunk of its own block, no more
    assert agg.stats["contributions"] == world * (world - 1) * 20


def test_more_reductions_at_once_than_the_aggregator_takes_all_finish():
    """The aggregator keeps MAX_REDUCTIONS of a communicator in flight and refuses the
    contributions of more; their ranks' credit stalls, their probes are answered with what to
    send again, and each is taken once there is room."""
    from overcast.aggregator.reduction import MAX_REDUCTIONS
    world, count = 3, 50
    fabric = Fabric(world, timeout=5.0, aggregator=Aggregator(slots=4))
    runs = [reduce_scatter(fabric, count, np.int64, slots=4, seq=seq)
            for seq in range(MAX_REDUCTIONS + 2)]
    fabric.run_timed()
    assert fabric.aggregator.stats["refused"] > 0
    for colls, outs, inputs in runs:
        check_done(colls)
        total = np.sum(inputs, axis=0)
        for r in range(world):
            assert np.array_equal(outs[r], total[r * count:(r + 1) * count])


def test_a_communicator_registered_after_another_left_is_a_new_one():
    """Keys registered without wire ids get ids of their own: one registered after another key
    left never shares a live communicator's ids, and with them its reductions."""
    agg = Aggregator(slots=8)
    agg.register("a", 2)
    agg.register("b", 2)
    payload = pack_contribution_prefix(dtype_code(np.dtype(np.int32)), 1, 2, 8) + bytes(16)
    agg.receive("b", Header(Kind.CONTRIB, 0, 0, 0, 0, AGGREGATOR, 1, len(payload), 0),
                memoryview(payload), 0.0)
    agg.unregister("a")
    agg.register("c", 2)
    assert agg.reductions("b") == {0: 0} and agg.reductions("c") == {}
