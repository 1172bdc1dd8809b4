"""The FSDP2 features of the compatibility matrix in docs/fsdp.md. Each is trained for a few steps
three ways in the same processes: through overlap(backend="overcast"), through
overlap(backend="torch"), and as plain FSDP2 on gloo; parameters are compared with plain FSDP2's
after every step, and the AllGather and ReduceScatter of the backward must have been in flight
at once where the feature leaves an AllGather in the backward."""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

import overcast
import overcast.fsdp
from overcast.cluster.launch import loopback_placements, run_ranks
from test_fsdp import LINK, batch, local_rows, max_diff, small_model

STEPS = 3


def shard_blocks(model, mesh, blocks=(1, 2, 3), root=True, **kwargs):
    from torch.distributed.fsdp import fully_shard
    for i in blocks:
        fully_shard(model[i], mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs) if root else model


def mse_step(model, step: int, rank: int, world: int, rows=None):
    x, y = (local_rows(t, rank, world) for t in batch(step))
    if rows is not None:
        x, y = x[rows], y[rows]
    loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    return loss.item()


def accumulate_step(model, step, rank, world, micro=4):
    """Gradient accumulation over `micro` micro-steps; only the last reduces gradients."""
    total = 0.0
    for i in range(micro):
        model.set_requires_gradient_sync(i == micro - 1)
        total += mse_step(model, step * micro + i, rank, world)
    return total / micro


class Tied(nn.Module):
    """A token model whose output head shares the embedding's weight, as GPT-2's does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 37)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(37, 37), nn.Tanh())
                                      for _ in range(3)])
        self.head = nn.Linear(37, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def tied_shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def tied_step(model, step, rank, world):
    g = torch.Generator().manual_seed(step)
    tokens = local_rows(torch.randint(0, 11, (12, 6), generator=g), rank, world)
    loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1),
                                       tokens[:, 1:].flatten())
    loss.backward()
    return loss.item()


def checkpointed(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i in (1, 2, 3):
        model[i] = checkpoint_wrapper(model[i])
    return model


def frozen(model):
    model[2][0].weight.requires_grad_(False)   # a whole unit with no gradient
    model[4].bias.requires_grad_(False)         # and part of the root's
    return model


def with_int16(model):
    model[2].register_parameter("count", nn.Parameter(torch.arange(5, dtype=torch.int16) * 1000,
                                                      requires_grad=False))
    return model


def policy(param, reduce):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)}


@dataclass
class Feature:
    """How to build, shard and train one row of the matrix."""

    shard: Callable = shard_blocks                # (model, mesh) -> FSDP2 model
    build: Callable = small_model
    step: Callable = mse_step                     # (model, step, rank, world) -> loss
    prepare: Callable = lambda model, reference: None  # after sharding
    mesh: tuple = (2,)
    # the largest parameter difference allowed against plain FSDP2 on gloo: bit-exact unless
    # the row says why not
    tolerance: float = 0.0
    overlaps: bool = True                         # an AllGather is left in the backward
    backends: tuple = ("overcast", "torch")
    kwargs: dict = field(default_factory=dict)    # more fully_shard arguments
    integer_parameters: bool = False              # needs fully_shard to shard int16


def set_divide_factor(model, reference):
    model.set_gradient_divide_factor(3.0)
    if reference:  # gloo has no PREMUL_SUM: plain FSDP2 on gloo must divide separately
        model.set_force_sum_reduction_for_comms(True)


FEATURES = {
    # 4 ranks: the aggregator adds the four contributions in another order than gloo
    "reshard_after_forward=True": Feature(mesh=(4,), tolerance=1e-7),
    "reshard_after_forward=False": Feature(kwargs={"reshard_after_forward": False},
                                           overlaps=False),
    "reshard_after_forward=2": Feature(mesh=(4,), kwargs={"reshard_after_forward": 2},
                                       backends=("torch",)),
    "gradient accumulation": Feature(step=accumulate_step),
    "activation checkpointing": Feature(build=lambda: checkpointed(small_model())),
    "mixed precision bfloat16/float32": Feature(kwargs=policy(torch.bfloat16, torch.float32)),
    "mixed precision float16": Feature(kwargs=policy(torch.float16, torch.float16)),
    # x/3 summed, against the sum divided by 3 on plain gloo: float32 rounding
    "gradient divide factor": Feature(prepare=set_divide_factor, tolerance=1e-7),
    "HSDP": Feature(mesh=(2, 2)),
    "fully_shard on a subset": Feature(shard=lambda m, mesh: shard_blocks(m, mesh, (1, 3))),
    "mixed parameter dtypes": Feature(build=lambda: with_int16(small_model()),
                                      integer_parameters=True),
    "frozen parameters": Feature(build=lambda: frozen(small_model())),
    "tied parameters": Feature(build=Tied, shard=tied_shard, step=tied_step),
}


def start(shape):
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    names = ("replicate", "shard") if len(shape) == 2 else None
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def overlapped(spans) -> bool:
    """Whether some AllGather and some ReduceScatter were in flight at the same time."""
    gathers = [(a, b) for kind, _, a, b in spans if kind == "AG"]
    return any(a < d and c < b for kind, _, c, d in spans if kind == "RS" for a, b in gathers)


def train_each_way(rank, name):
    feature = FEATURES[name]
    mesh = start(feature.mesh)
    world = dist.get_world_size()
    try:
        models = {}
        for way in ("gloo",) + feature.backends:
            models[way] = feature.shard(feature.build(), mesh, **feature.kwargs)
            feature.prepare(models[way], way == "gloo")
        handles = {b: overcast.fsdp.overlap(models[b], backend=b, trace=True)
                   for b in feature.backends}
        opts = {way: torch.optim.SGD(m.parameters(), lr=0.2) for way, m in models.items()}
        losses = {way: [] for way in models}
        diffs = {b: [] for b in feature.backends}
        for step in range(STEPS):
            for way, model in models.items():
                losses[way].append(feature.step(model, step, rank, world))
                opts[way].step()
                opts[way].zero_grad()
            for b in feature.backends:
                diffs[b].append(max(max_diff(p.to_local(), q.to_local()) for p, q in
                                    zip(models[b].parameters(), models["gloo"].parameters())))
        result = {"losses": losses, "diffs": diffs,
                  "overlapped": {b: overlapped(h.spans()) for b, h in handles.items()},
                  "counts": {b: h.stats() for b, h in handles.items()}}
        for h in handles.values():
            h.close()
        return result
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_trains_as_plain_fsdp2_on_gloo(name, request):
    feature = FEATURES[name]
    if feature.integer_parameters:
        request.getfixturevalue("integer_parameters")
    world = 1
    for n in feature.mesh:
        world *= n
    for r in run_ranks(train_each_way, loopback_placements(world, LINK), args=(name,),
                       timeout=180):
        for b in feature.backends:
            assert max(r["diffs"][b]) <= feature.tolerance, (b, r["diffs"])
            assert r["overlapped"][b] == feature.overlaps, (b, r["counts"][b])
            assert r["counts"][b]["reduce_scatters"] > 0, r["counts"][b]


# How each model of backward_reduce_scatters is set up: (defer_reduce_scatter, FSDP2's
# ReduceScatter input buffers in flight, a post-accumulate-grad hook on every parameter)
DEFERRALS = {"deferred": (True, 1, False), "deferred, 4 in flight": (True, 4, False),
             "blocking": (False, 1, False), "hooked": (True, 4, True)}
# FSDPModule.set_reduce_scatter_max_input_buffers (torch 2.13 on); before it FSDP2 keeps one
BUFFERS_SETTABLE = hasattr(FSDPModule, "set_reduce_scatter_max_input_buffers")


def backward_reduce_scatters(rank, backend):
    """Two backward passes of each model of DEFERRALS, the second onto the first's gradients:
    each pass's spans (kind, posted, waited) in posting order, the gradients, and what the
    hooks saw. All handles are open at once, sharing backend="torch"'s one ReduceScatter
    group. Where torch keeps one ReduceScatter input only, every model has one, and the model
    with room for 4 is left out."""
    mesh = start((2,))
    try:
        out, handles, models = {}, {}, {}
        for way, (defer, buffers, hooked) in DEFERRALS.items():
            if not BUFFERS_SETTABLE and way == "deferred, 4 in flight":
                continue
            models[way] = model = shard_blocks(small_model(), mesh)
            if BUFFERS_SETTABLE:
                model.set_reduce_scatter_max_input_buffers(buffers)
            seen = out.setdefault(way, {"hooks": []})["hooks"]
            if hooked:  # it reads the gradient as soon as FSDP2 sets it
                for p in model.parameters():
                    p.register_post_accumulate_grad_hook(
                        lambda p, seen=seen: seen.append(p.grad.to_local().sum().item()))
            handles[way] = overcast.fsdp.overlap(model, backend=backend, trace=True,
                                                 defer_reduce_scatter=defer)
        for way, model in models.items():
            passes = []
            for step in range(2):  # no zero_grad: the second accumulates onto the first
                posted = len(handles[way].spans())
                mse_step(model, step, rank, 2)
                passes.append(sorted((kind, a, b) for kind, _, a, b in
                                     handles[way].spans()[posted:]))
            out[way].update(passes=passes, grads=[p.grad.to_local().tolist()
                                                  for p in model.parameters()],
                            final=[p.grad.to_local().sum().item() for p in model.parameters()])
        for handle in handles.values():
            handle.close()
        return out
    finally:
        dist.destroy_process_group()


def _gathered_behind(spans) -> bool:
    """Whether some AllGather was posted while a ReduceScatter was in flight."""
    return any(a_post > r_post and a_post < r_end for kind, r_post, r_end in spans
               if kind == "RS" for other, a_post, _ in spans if other == "AG")


@pytest.mark.parametrize("backend", ["overcast", "torch"])
def test_reduce_scatter_runs_behind_the_backward_until_it_ends(backend):
    """Deferred, the next blocks' AllGathers are posted while a ReduceScatter is in flight, and
    with room for 4 every ReduceScatter of the pass is still in flight when the last is
    posted: the backward pass waits for them at its end. Blocking (defer_reduce_scatter=False),
    onto gradients already there, or with a post-accumulate-grad hook (FSDP2 then reads the
    result at once), each one ends before anything else is posted. The gradients are bit-exact
    the same every way, and the hooks saw the final ones."""
    for r in run_ranks(backward_reduce_scatters, loopback_placements(2, LINK),
                       args=(backend,), timeout=120):
        ways = [way for way in DEFERRALS if BUFFERS_SETTABLE or way != "deferred, 4 in flight"]
        assert sorted(r) == sorted(ways), r.keys()
        first = {way: r[way]["passes"][0] for way in ways}
        assert _gathered_behind(first["deferred"]), first["deferred"]
        if BUFFERS_SETTABLE:
            four = [(a, b) for kind, a, b in first["deferred, 4 in flight"] if kind == "RS"]
            assert len(four) == 4 and min(b for _, b in four) > max(a for a, _ in four), four
        for spans in [first["blocking"], first["hooked"]] + \
                [r[way]["passes"][1] for way in ways]:
            assert not _gathered_behind(spans), spans
            reduces = [(a, b) for kind, a, b in spans if kind == "RS"]
            assert len(reduces) == 4 and all(end <= nxt for (_, end), (nxt, _) in
                                             zip(reduces, reduces[1:])), reduces
        for way in ways:
            assert r[way]["grads"] == r["blocking"]["grads"], way
        hooked = r["hooked"]  # the second pass's hooks, in the order FSDP2 reduced them
        assert sorted(hooked["hooks"][-len(hooked["final"]):]) == sorted(hooked["final"])


def offloaded(model, mesh):
    from torch.distributed.fsdp import CPUOffloadPolicy
    return shard_blocks(model, mesh, offload_policy=CPUOffloadPolicy())


# Rows refused, per backend: how the model is sharded, and the words of the refusal (TORCH_SAYS:
# torch's own, whatever its version words it, the same through both backends). CPU offload is
# refused by fully_shard itself on a host without an accelerator (it pins host memory).
TORCH_SAYS = "torch's own refusal"
REFUSED = {
    "reshard_after_forward=2": (lambda m, mesh: shard_blocks(m, mesh, reshard_after_forward=2),
                                {"overcast": "reshard_after_forward=<int>"}),
    "unsharded root": (lambda m, mesh: shard_blocks(m, mesh, range(5), root=False),
                       {"overcast": "Call fully_shard(model) on the root as well",
                        "torch": "Call fully_shard(model) on the root as well"}),
}
if not torch.cuda.is_available():
    REFUSED["CPU offload"] = (offloaded, {"overcast": TORCH_SAYS, "torch": TORCH_SAYS})


def refusals(rank):
    mesh = start((4,))
    messages = {}
    try:
        for name, (shard, backends) in REFUSED.items():
            for backend in backends:
                try:
                    overcast.fsdp.overlap(shard(small_model(), mesh), backend=backend).close()
                    messages[f"{name}/{backend}"] = None
                except (overcast.InvalidArgumentError, RuntimeError) as err:
                    messages[f"{name}/{backend}"] = f"{type(err).__name__}: {err}"
        return messages
    finally:
        dist.destroy_process_group()


def test_refused_features_say_what_to_do():
    results = run_ranks(refusals, loopback_placements(4, LINK), timeout=120)
    for name, (_, backends) in REFUSED.items():
        for backend, words in backends.items():
            for messages in results:
                said = messages[f"{name}/{backend}"]
                if words is TORCH_SAYS:
                    assert said and said.startswith("RuntimeError: ") and \
                        said == messages[f"{name}/torch"], messages
                else:
                    assert words in (said or ""), messages


def profiled(rank, backend, path):
    """One warm-up step, then one under torch.profiler; the trace is written to `path`."""
    from torch.profiler import ProfilerActivity, profile
    mesh = start((2,))
    try:
        model = shard_blocks(small_model(), mesh)
        with overcast.fsdp.overlap(model, backend=backend):
            mse_step(model, 0, rank, 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                mse_step(model, 1, rank, 2)
            if rank == 0:
                prof.export_chrome_trace(path)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend,algorithms", [
    ("overcast", ("ring", "multicast", "innetwork")), ("torch", ("process group",) * 3)])
def test_collectives_appear_in_torch_profiler_traces(backend, algorithms, tmp_path):
    path = str(tmp_path / "trace.json")
    run_ranks(profiled, loopback_placements(2, LINK), args=(backend, path), timeout=120)
    events = [e for e in json.load(open(path))["traceEvents"]
              if e.get("ph") == "X" and e["name"].startswith("overcast ")]
    names = {e["name"] for e in events}
    forward, backward, rs = algorithms
    # forward: root and blocks 1-3; backward: blocks 3-1 again; a ReduceScatter per unit
    for unit in ("root", "1", "2", "3"):
        assert f"overcast AllGather {unit} ({forward})" in names, names
        assert f"overcast ReduceScatter {unit} ({rs})" in names, names
    for unit in ("1", "2", "3"):
        assert f"overcast AllGather {unit} ({backward})" in names, names
    spans = [("AG" if "AllGather" in e["name"] else "RS", e["name"], e["ts"], e["ts"] + e["dur"])
             for e in events]
    assert overlapped(spans), spans


def quiet(handle) -> None:
    """Let the engine settle before a snapshot: a barrier after the step's collectives, so the
    engine thread holds the same (a finished barrier) at every snapshot, then a collection, and
    the interpreter's type attribute cache emptied (it keeps the name strings of lookups made
    from C, such as torch's for a DTensor's `.grad`, and tracemalloc counts them where the
    lookup was made)."""
    handle.comm.barrier()
    gc.collect()
    sys._clear_type_cache()


def held_memory(rank, steps, compare_from):
    """What the communicator holds after each step, and what Python allocated in overcast's
    code and still holds, between step `compare_from` and the last."""
    mesh = start((2,))
    try:
        model = shard_blocks(small_model(), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        only = [tracemalloc.Filter(True, "*/overcast/*")]
        held = []
        tracemalloc.start()
        with overcast.fsdp.overlap(model) as handle:
            for step in range(steps):
                if step == compare_from:
                    quiet(handle)
                    before = tracemalloc.take_snapshot().filter_traces(only)
                mse_step(model, step, rank, 2)
                opt.step()
                opt.zero_grad()
                held.append(json.dumps(handle.memory()))  # kept as text: not in overcast's code
            quiet(handle)
            after = tracemalloc.take_snapshot().filter_traces(only)
            grown = [(str(d.traceback), d.size_diff)
                     for d in after.compare_to(before, "lineno") if d.size_diff > 0]
            chunk = handle.comm.chunk_bytes
            endpoints = handle.comm.aggregator_endpoints
        return {"held": [json.loads(h) for h in held], "grown": grown, "chunk": chunk,
                "endpoints": endpoints}
    finally:
        tracemalloc.stop()
        dist.destroy_process_group()


def test_memory_is_reported_and_does_not_grow_with_steps():
    """After the first step nothing grows: not the buffers the communicator reports, and not
    Python's allocations in overcast, once the session's bounded history of collectives (the
    last 1,024 descriptors, kept to check a late DESCRIBE) is full and drops sequence numbers
    past Python's cached small ints: 11 collectives a step, so from step 120."""
    for r in run_ranks(held_memory, loopback_placements(2, LINK), args=(150, 125), timeout=180):
        first = r["held"][0]
        assert first["collectives_in_flight"] == 0 and first["collective_state_bytes"] == 0
        # the aggregator's slots for this communicator, one chunk per rank each, in every one
        # of its shards (the aggregator rank 0 starts has one per core)
        assert r["endpoints"] >= 1
        assert 0 < first["aggregator_slot_bytes"] <= r["endpoints"] * 256 * 2 * r["chunk"], first
        for later in r["held"][1:]:  # the same after every step; TCP may tune its buffers
            kernel = later.pop("socket_buffer_bytes")
            assert kernel <= 2 * first["socket_buffer_bytes"], r["held"]
            assert later == {k: v for k, v in first.items() if k != "socket_buffer_bytes"}
        assert sum(size for _, size in r["grown"]) < 2048, r["grown"]
