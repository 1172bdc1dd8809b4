"""A plain DistributedDataParallel training script whose only overcast line is the import: the
process group is "overcast" (or gloo, to compare). Run it with torchrun:

    torchrun --standalone --nproc-per-node 4 examples/ddp_train.py
    torchrun --standalone --nproc-per-node 4 examples/ddp_train.py --backend gloo

Rank 0 prints each step's loss (averaged over the ranks with all_reduce) to 9 significant
digits, so the two runs can be compared line by line. The data are the same whatever the
backend: each rank takes its rows of one seeded global batch per step, so the losses are also
those of one process training on the whole batch.

On gloo, torch 2.13 can abort a process at exit ("terminate called without an active
exception") after the last step has printed: a gloo worker thread frees a backward's Work while
the interpreter finalizes (docs/fsdp.md).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import overcast.distributed  # noqa: F401  (registers the "overcast" backend)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.LayerNorm(256), nn.Linear(256, 10))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: inputs and class labels, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 32, generator=g), torch.randint(0, 10, (rows,), generator=g)


def step_loss(net: nn.Module, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    """One optimizer step on the rows `x`, `y`: their loss before it."""
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def train_step(net: nn.Module, opt: torch.optim.Optimizer, x, y, step: int) -> None:
    """One step on this rank's rows; rank 0 prints the loss averaged over the ranks."""
    loss = step_loss(net, opt, x, y)
    total = loss.detach().clone()
    dist.all_reduce(total)  # a SUM: gloo has no AVG
    if dist.get_rank() == 0:
        print(f"step {step:3d}  loss {total.item() / dist.get_world_size():.9g}", flush=True)


def one_process_losses(steps: int, rows: int) -> list[float]:
    """The losses of one process training the model on each step's whole batch: what the ranks
    print, to float32 rounding (their gradients of equal row counts are averaged, as DDP's)."""
    net = model()
    opt = optimizer(net.parameters())
    return [step_loss(net, opt, *batch(step, rows)).item() for step in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="overcast", choices=("overcast", "gloo"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global rows per step")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = nn.parallel.DistributedDataParallel(model())
    opt = optimizer(ddp.parameters())
    rows = args.batch // world
    for step in range(args.steps):
        x, y = batch(step, args.batch)
        train_step(ddp, opt, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows],
                   step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
