"""FSDP2 training on the "overcast" backend that comes back from a lost rank: every few steps it
saves a torch.distributed.checkpoint (DCP) of the sharded model and optimizer, and when torchrun
restarts the job (`--max-restarts`) every rank loads the latest one and goes on from there.

    OVERCAST_LINK_BITS_PER_S=10e9 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/restart.py --checkpoints ckpt
    OVERCAST_LINK_BITS_PER_S=10e9 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/restart.py --checkpoints ckpt2 --kill-rank 1 --kill-step 6

The second run kills rank 1 (SIGKILL, after its forward pass) at step 6, in the job's first
attempt only (torchrun's TORCHELASTIC_RESTART_COUNT is 0): the other rank's backward fails with
the peer named, torchrun stops it and starts both again, and they resume from the checkpoint of
step 4. Each step's global batch is drawn from a generator seeded by the step, so the steps
after the restart are the uninterrupted run's, and both end on the same loss, bit for bit.
Rank 0 prints each step's loss (averaged over the ranks) as it goes, and the last one as
float.hex. The checkpoints stay in the folder given; a run that finds one there resumes from it.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import overcast.distributed  # noqa: F401  (registers the "overcast" backend)
import overcast.fsdp

ROWS = 16  # the global batch


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 10))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 32, generator=g), torch.randint(0, 10, (ROWS,), generator=g)


def latest(folder: str) -> int:
    """The step of the newest complete checkpoint in `folder` (0: none). DCP writes a
    checkpoint's .metadata last, once every rank's data is written."""
    done = [int(name.split("-")[1]) for name in os.listdir(folder) if name.startswith("step-")
            and os.path.exists(os.path.join(folder, name, ".metadata"))]
    return max(done, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", required=True, help="the folder of the checkpoints")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--kill-rank", type=int, help="the rank to kill, in the first attempt")
    parser.add_argument("--kill-step", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("overcast")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    os.makedirs(args.checkpoints, exist_ok=True)
    first = latest(args.checkpoints)
    if first:
        model_state, opt_state = get_state_dict(net, opt)
        state = {"model": model_state, "optim": opt_state}
        dcp.load(state, checkpoint_id=os.path.join(args.checkpoints, f"step-{first}"))
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from the checkpoint of step {first}", flush=True)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with overcast.fsdp.overlap(net):
        for step in range(first, args.steps):
            x, y = batch(step)
            loss = nn.functional.cross_entropy(net(x[rows]), y[rows])
            if (rank, step, attempt) == (args.kill_rank, args.kill_step, 0):
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others are in backward
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step:3d}  loss {total.item() / world:.9g}", flush=True)
            if rank == 0 and step == args.steps - 1:
                print(f"final loss {(total.item() / world).hex()}", flush=True)
            if (step + 1) % args.every == 0:
                model_state, opt_state = get_state_dict(net, opt)
                dcp.save({"model": model_state, "optim": opt_state},
                         checkpoint_id=os.path.join(args.checkpoints, f"step-{step + 1}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
