"""A model of one's own under overcast: a GPT written here with plain torch.nn (nothing from
overcast.train), sharded with stock FSDP2 (every block resharded after forward), trained with
AdamW, its collectives routed by `overcast.fsdp.overlap(model)`. One process per rank:

    overcast cluster run --hosts 4 --link-mbit 100 -- python examples/own_model.py
    overcast cluster run --hosts 4 --link-mbit 100 -- python examples/own_model.py --way rings
    overcast cluster run --hosts 4 --link-mbit 100 -- python examples/own_model.py --way torch
    OVERCAST_LINK_BITS_PER_S=10e9 torchrun --standalone --nproc-per-node 4 examples/own_model.py

`--way` picks overcast (multicast AllGather beside in-network ReduceScatter in the backward, the
forward's AllGathers on its ring), overcast's rings, or the
process group's own collectives (gloo here) with ReduceScatter on a group of its own; all three
see the same weights and batches, so their losses agree. Rank 0 prints each step's loss and
time (the slowest rank's).
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import overcast.fsdp

WAYS = {"overcast": {}, "rings": {"allgather": "ring", "reduce_scatter": "ring"},
        "torch": {"backend": "torch"}}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, blocks: int, dim: int, heads: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions[:idx.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--way", default="overcast", choices=WAYS)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-step")
    p.add_argument("--micro-steps", type=int, default=1,
                   help="gradient accumulation: micro-batches per optimizer step")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    args = p.parse_args()

    dist.init_process_group("gloo")            # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                       # the same weights on every rank and in every way
    model = GPT(args.vocab, args.blocks, args.dim, 8, args.seq)
    if args.checkpoint:
        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.Generator().manual_seed(1 + rank)

    with overcast.fsdp.overlap(model, **WAYS[args.way]):
        for step in range(args.steps):
            dist.barrier()
            start = time.monotonic()
            for micro in range(args.micro_steps):
                model.set_requires_gradient_sync(micro == args.micro_steps - 1)
                idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=batches)
                loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds = torch.tensor([time.monotonic() - start])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.9f} time {seconds.item():.3f} s",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
