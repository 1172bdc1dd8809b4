"""Train a small GPT with stock PyTorch FSDP2, its backward-pass AllGather and ReduceScatter
overlapped by overcast. One process per rank, started by any torchrun-style launcher:

    overcast cluster run --hosts 4 --link-mbit 100 -- python examples/train_gpt.py
    OVERCAST_LINK_BITS_PER_S=10e9 torchrun --standalone --nproc-per-node 4 examples/train_gpt.py

`--backend torch` trains the same way through the process group's own collectives (gloo here,
NCCL on GPUs) with ReduceScatter on a group of its own; `--allgather ring --reduce-scatter ring`
uses overcast's rings. `overcast train` runs this model four ways side by side and compares them.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import overcast.fsdp
from overcast.train.config import GPTConfig
from overcast.train.gpt import build, rank_batch, shard


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="overcast", choices=overcast.fsdp.BACKENDS)
    p.add_argument("--allgather", default="multicast", choices=("multicast", "ring"))
    p.add_argument("--reduce-scatter", default="innetwork", choices=("innetwork", "ring"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    args = p.parse_args()

    dist.init_process_group("gloo")            # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(blocks=args.blocks, dim=args.dim)
    model = shard(build(cfg), init_device_mesh("cpu", (world,)))   # fully_shard blocks, then root
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {} if args.backend == "torch" else {"allgather": args.allgather,
                                                  "reduce_scatter": args.reduce_scatter}
    with overcast.fsdp.overlap(model, backend=args.backend, **options) as handle:
        for step in range(args.steps):
            loss = model(*rank_batch(cfg, step, rank, world))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0:
                print(f"step {step}: loss {loss.item():.6f}", flush=True)
        if rank == 0:
            print(f"communication on the training thread: {handle.stats()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
