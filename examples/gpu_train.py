"""DDP and FSDP2 on CUDA tensors with the "overcast" process group (or gloo, to compare), the
model and data of examples/ddp_train.py. Run it with torchrun, as many ranks as you like on one
GPU or one each (rank r uses GPU LOCAL_RANK mod the GPUs there are); no root is needed:

    torchrun --standalone --nproc-per-node 2 examples/gpu_train.py --way ddp
    OVERCAST_LINK_BITS_PER_S=10e9 torchrun --standalone --nproc-per-node 2 examples/gpu_train.py \
        --way overlap
    torchrun --standalone --nproc-per-node 2 examples/gpu_train.py --way fsdp --backend gloo

--way ddp: DistributedDataParallel; fsdp: FSDP2 (`fully_shard` per layer) on the process group's
collectives; overlap: the same FSDP2 model through `overcast.fsdp.overlap()`, its AllGathers and
ReduceScatters on overcast's communicator (multicast paces itself to the links' rate, which
OVERCAST_LINK_BITS_PER_S gives: your network's; 10e9 stands for one machine's loopback). The
tensors stay on the GPU: overcast stages them
through pinned host memory. Rank 0 prints each step's loss, averaged over the ranks, to 9
significant digits, the same lines whatever the backend and way (those of one process training on
the whole batch). `--device cpu` runs the same on CPU tensors.
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import overcast.distributed  # registers the "overcast" backend
import overcast.fsdp
from ddp_train import batch, model, optimizer, train_step  # the example beside this one


def sharded(net: nn.Module, device: torch.device) -> nn.Module:
    """`net` under FSDP2, each Linear a unit of its own, over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="overcast", choices=("overcast", "gloo"))
    parser.add_argument("--way", default="ddp", choices=("ddp", "fsdp", "overlap"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global rows per step")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_train: no CUDA GPU here (run it with --device cpu)")
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"gpu_train: --batch {args.batch} does not divide among {world} ranks")
    net = model().to(device)
    if args.way == "ddp":
        net = nn.parallel.DistributedDataParallel(net)
    else:
        net = sharded(net, device)
    opt = optimizer(net.parameters())
    rows = args.batch // world
    with overcast.fsdp.overlap(net) if args.way == "overlap" else contextlib.nullcontext():
        for step in range(args.steps):
            x, y = (t[rank * rows : (rank + 1) * rows].to(device) for t in batch(step, args.batch))
            train_step(net, opt, x, y, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
