"""The timelines drawn from given traces (overcast/report/timeline.py): each collective on its
lane and, from a run on a GPU, each staging copy to the host and back on lanes of their own,
placed on the trace's clock; copies outside the run are left out."""

import json

from overcast.report.timeline import chrome_trace, every_span, figure, write_timeline

LINK_BITS = 1e9


def trace(copies: list[dict] | None = None) -> dict:
    """A rank's trace of an AllGather from 10.0 s to 10.2 s and a ReduceScatter from 10.1 s to
    10.4 s, each with the bytes of one 2 ms bin on the link; and `copies` if given."""
    out = {
        "bin_seconds": 0.002,
        "clock": "monotonic",
        "spans": [
            {"seq": 1, "name": "all_gather(multicast, 1000 x float32)", "start": 10.0,
             "end": 10.2, "label": "AG blocks.1"},
            {"seq": 2, "name": "reduce_scatter(innetwork, 1000 x float32)", "start": 10.1,
             "end": 10.4, "label": "RS blocks.1"},
        ],
        "bins": [
            {"direction": "rx", "seq": 1, "bin": 5025, "bytes": 4000},
            {"direction": "tx", "seq": 2, "bin": 5100, "bytes": 4000},
        ],
    }
    if copies is not None:
        out["copies"] = copies
    return out


COPIES = [
    {"direction": "to host", "start": 10.05, "end": 10.06},
    {"direction": "to GPU", "start": 10.39, "end": 10.41},
    {"direction": "to host", "start": 11.0, "end": 11.01},  # after the run
]


def lanes(events: list[dict], rank: int = 0) -> dict[int, set[str]]:
    """Each lane's names: one each, as a viewer shows a thread by its last."""
    named: dict[int, set[str]] = {}
    for e in events:
        if e["name"] == "thread_name" and e["pid"] == rank:
            named.setdefault(e["tid"], set()).add(e["args"]["name"])
    return named


def bars(events: list[dict], rank: int = 0) -> list[tuple[str, int, float, float]]:
    return sorted((e["name"], e["tid"], e["ts"], e["dur"]) for e in events
                  if e["ph"] == "X" and e["pid"] == rank)


def test_the_copies_are_drawn_on_lanes_of_their_own_beside_the_collectives():
    events = chrome_trace([trace(COPIES), trace()], LINK_BITS, every_span)["traceEvents"]
    collectives = {1: {"AllGather / Broadcast"}, 2: {"ReduceScatter"}}
    assert lanes(events, 0) == {**collectives, 4: {"copy to host"}, 5: {"copy to GPU"}}
    assert bars(events, 0) == [
        ("AG blocks.1", 1, 0.0, 200000.0),
        ("RS blocks.1", 2, 100000.0, 300000.0),
        ("copy to GPU", 5, 390000.0, 20000.0),
        ("copy to host", 4, 50000.0, 10000.0),
    ]
    # a rank without copies (on CPU) has no copy lanes
    assert lanes(events, 1) == collectives
    assert [b[1] for b in bars(events, 1)] == [1, 2]


def test_each_lane_is_named_once_and_the_other_lane_only_when_used():
    """A viewer names a thread by its last name: lane 1 carries AllGathers and broadcasts, so
    it is named for both at once; a collective of neither lane gets an "other" lane."""
    plain = chrome_trace([trace()], LINK_BITS, every_span)["traceEvents"]
    assert lanes(plain) == {1: {"AllGather / Broadcast"}, 2: {"ReduceScatter"}}
    mixed = trace()
    mixed["spans"].append({"seq": 3, "name": "all_reduce(ring, 8 x float32)", "start": 10.2,
                           "end": 10.3})
    events = chrome_trace([mixed], LINK_BITS, every_span)["traceEvents"]
    assert lanes(events) == {1: {"AllGather / Broadcast"}, 2: {"ReduceScatter"}, 3: {"other"}}
    assert ("all_reduce(ring, 8 x float32)", 3, 200000.0, 100000.0) in bars(events)


def test_the_picture_has_a_row_per_copy_direction_only_when_there_were_copies():
    with_copies = figure(trace(COPIES), LINK_BITS, "run", every_span)
    without = figure(trace(), LINK_BITS, "run", every_span)
    rows = lambda fig: [t.get_text() for t in fig.axes[0].get_yticklabels()]  # noqa: E731
    assert rows(with_copies) == ["AllGather", "ReduceScatter", "copy to host", "copy to GPU"]
    assert rows(without) == ["AllGather", "ReduceScatter"]
    # one bar per collective and per copy in the run, on its row, from the run's start (ms)
    drawn = sorted(
        (round(box.y0 + 0.4), round(box.x0, 3), round(box.width, 3))
        for bars_ in with_copies.axes[0].collections
        for box in (path.get_extents() for path in bars_.get_paths())
    )
    assert drawn == [(1, 0.0, 200.0), (2, 100.0, 300.0), (3, 50.0, 10.0), (4, 390.0, 20.0)]


def test_a_timeline_with_copies_is_written(tmp_path):
    path = str(tmp_path / "timeline")
    write_timeline([trace(COPIES)], path, LINK_BITS, "run", every_span)
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert lanes(events)[4] == {"copy to host"}
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
