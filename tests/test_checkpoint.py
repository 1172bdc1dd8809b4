"""torch.distributed.checkpoint (DCP) on the "overcast" backend: an FSDP2 model and its AdamW
state saved by one job and loaded by another, at the same world size and at another, with and
without overlap(); what is loaded is what was saved, bit for bit, and the steps that follow give
gloo's losses; a whole state dict broadcast from rank 0, and an async_save; examples/restart.py,
killed mid-step under torchrun, comes back to an uninterrupted run's losses."""

import copy
import datetime
import os
import pathlib
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

import overcast.distributed  # noqa: F401  (registers the "overcast" backend)
import overcast.fsdp
from conftest import run_marked
from overcast.cluster.launch import loopback_placements, run_ranks

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = {"OVERCAST_LINK_BITS_PER_S": "1e9"}  # loopback has no rate; multicast paces to this
ROWS = 12  # global batch, split evenly over 2 or 4 ranks
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 37), nn.Tanh(), nn.Linear(37, 37), nn.Tanh(),
                         nn.Linear(37, 5))


def sharded(backend: str, with_overlap: bool):
    """The model under fully_shard on every rank of a new job, its optimizer, and overlap()'s
    handle (or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = small_model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = overcast.fsdp.overlap(model) if with_overlap else None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), handle


def step(model, opt, rank: int, n: int) -> str:
    """Step n of training on this rank's rows of the step's global batch; the loss averaged over
    the ranks, as float.hex (every bit)."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(ROWS, 7, generator=g), torch.randn(ROWS, 5, generator=g)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    loss = nn.functional.mse_loss(model(x[rows]), y[rows])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # a SUM: gloo has no AVG
    return (total.item() / world).hex()


def save_or_load(rank, backend, with_overlap, checkpoint, full_copy, saving):
    """Saving: two steps, then DCP's save of the sharded model and optimizer state. Loading: DCP's
    load into a fresh model, then two more steps; their losses. Either way rank 0 writes the
    whole (unsharded) model and optimizer state to `full_copy` (before the steps, loading)."""
    model, opt, handle = sharded(backend, with_overlap)
    try:
        if saving:
            for n in range(2):
                step(model, opt, rank, n)
        model_state, opt_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": opt_state}
        if saving:
            dcp.save(state, checkpoint_id=checkpoint)
        else:
            dcp.load(state, checkpoint_id=checkpoint)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        whole = {"model": get_model_state_dict(model, options=FULL),
                 "optim": get_optimizer_state_dict(model, opt, options=FULL)}
        if rank == 0:
            torch.save(whole, full_copy)
        return [] if saving else [step(model, opt, rank, n) for n in (2, 3)]
    finally:
        if handle is not None:
            handle.close()
        dist.destroy_process_group()


def differences(a, b, where="") -> list[str]:
    """Where two state dicts differ: keys, types, or a tensor's dtype, shape or any bit."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a, key=str)} against {sorted(b, key=str)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}/{i}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = (a.dtype == b.dtype and a.shape == b.shape and
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        return [] if same else [f"{where}: {a.dtype} {tuple(a.shape)} against {b.dtype} "
                                f"{tuple(b.shape)} or their bits"]
    return [] if a == b else [f"{where}: {a!r} against {b!r}"]


@pytest.mark.parametrize("saved_at,loaded_at,with_overlap", [(4, 2, True), (2, 4, False)])
def test_a_checkpoint_loads_bit_exact_and_trains_on_as_gloo(saved_at, loaded_at, with_overlap,
                                                            tmp_path):
    checkpoint = tmp_path / "checkpoint"
    saved, loaded = tmp_path / "saved.pt", tmp_path / "loaded.pt"
    run_ranks(save_or_load, loopback_placements(saved_at, LINK),
              args=("overcast", with_overlap, str(checkpoint), str(saved), True), timeout=120)
    losses = run_ranks(save_or_load, loopback_placements(loaded_at, LINK),
                       args=("overcast", with_overlap, str(checkpoint), str(loaded), False),
                       timeout=120)
    assert differences(torch.load(saved), torch.load(loaded)) == []
    gloo = run_ranks(save_or_load, loopback_placements(loaded_at),
                     args=("gloo", False, str(checkpoint), str(tmp_path / "gloo.pt"), False),
                     timeout=120)
    assert losses == gloo and len(set(map(tuple, losses))) == 1, (losses, gloo)


def broadcast_and_async_save(rank, backend, folder):
    """A whole state dict held by rank 0 alone, loaded into the sharded model with
    broadcast_from_rank0 (how a job loads one file without every rank reading it), and an
    async_save of the sharded model loaded back; each as rank 0's whole state dict, or what
    torch raised."""
    model, _, _ = sharded(backend, False)
    whole = small_model().state_dict()
    for t in whole.values():
        t.add_(1)  # not the model's own values
    out = {}

    def differs() -> list[str]:  # on rank 0, which the whole state dict is gathered to
        now = get_model_state_dict(model, options=FULL)
        return differences(now, whole) if rank == 0 else []
    try:
        set_model_state_dict(model, copy.deepcopy(whole) if rank == 0 else {},  # it is taken
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=True))
        out["broadcast"] = differs()
    except Exception as err:  # what torch raised is the finding
        out["broadcast"] = f"{type(err).__name__}: {err}"
    try:
        checkpoint = os.path.join(folder, backend)
        dcp.async_save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint).result()
        state = {"model": get_model_state_dict(model)}  # the parameters themselves
        for t in state["model"].values():
            t.to_local().zero_()
        dcp.load(state, checkpoint_id=checkpoint)
        out["async_save"] = differs()
    except Exception as err:
        out["async_save"] = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
    return out


def test_a_whole_state_dict_broadcast_from_rank_0_and_an_async_save_work_as_on_gloo(tmp_path):
    """torch looks up a group's devices for both (a Python process group registers none with
    torch): broadcast_from_rank0 took the first of an empty list, async_save refused."""
    for backend in ("overcast", "gloo"):
        assert run_ranks(broadcast_and_async_save, loopback_placements(2),
                         args=(backend, str(tmp_path)), timeout=120) == \
            [{"broadcast": [], "async_save": []}] * 2, backend


def restart_example(checkpoints: str, *extra: str) -> tuple[list[str], list[int]]:
    """examples/restart.py under torchrun, 2 ranks, one restart allowed: rank 0's output lines,
    and the processes of the run still there once torchrun has returned (killed then)."""
    run, left = run_marked([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", "--max-restarts", "1",
                            str(ROOT / "examples" / "restart.py"), "--checkpoints", checkpoints,
                            *extra], {"OVERCAST_LINK_BITS_PER_S": "1e9"}, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines(), left


def test_the_restart_example_comes_back_from_a_killed_rank_with_the_uninterrupted_loss():
    """Rank 1 killed in step 6 of 12 (once): torchrun starts both ranks again, they load the
    checkpoint of step 4, and steps 4 to 11 give the uninterrupted run's losses, the last one
    bit for bit. Nothing of either run is left running; the checkpoints go with the folder."""
    with tempfile.TemporaryDirectory() as folder:
        whole, left = restart_example(os.path.join(folder, "whole"))
        assert left == []
        broken, left = restart_example(os.path.join(folder, "broken"), "--kill-rank", "1",
                                       "--kill-step", "6")
        assert left == []
    steps = [line for line in whole if line.startswith("step")]
    assert len(steps) == 12 and whole[-1].startswith("final loss"), whole
    # the first attempt's steps 0 to 5, then the second's from the checkpoint of step 4
    assert broken == steps[:6] + ["resumed from the checkpoint of step 4"] + steps[4:] + \
        [whole[-1]], (broken, whole)
