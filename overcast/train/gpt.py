"""A small decoder-only transformer and seeded synthetic tokens: the training workload of
`overcast train` and examples/train_gpt.py. Pure torch, built to a shape of
overcast.train.config."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from overcast.train.config import GPTConfig


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(b, t, 3, self.heads, d // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.position = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of `tokens` against `targets`."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(cfg: GPTConfig) -> TinyGPT:
    """The model with the same initial weights on every rank (seeded)."""
    torch.manual_seed(cfg.seed)
    return TinyGPT(cfg)


def global_batch(cfg: GPTConfig, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch for all ranks, (inputs, targets) of world*batch_per_rank rows.

    Each row counts up from a random start by a random stride modulo the vocabulary, so the
    next token follows from the previous two and the loss can fall."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    rows = world * cfg.batch_per_rank
    start = torch.randint(0, cfg.vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    return tokens[:, :-1], tokens[:, 1:]


def rank_batch(cfg: GPTConfig, step: int, rank: int, world: int):
    """This rank's rows of `global_batch`."""
    inputs, targets = global_batch(cfg, step, world)
    rows = slice(rank * cfg.batch_per_rank, (rank + 1) * cfg.batch_per_rank)
    return inputs[rows], targets[rows]


def shard(model: TinyGPT, mesh, **fully_shard_kwargs) -> TinyGPT:
    """fully_shard every block, then the root (embeddings, final norm and head). The blocks
    `cfg.reshard` names free their parameters after forward; by default all but the last, as
    torchtitan does: backward needs the last at once. With activation checkpointing each block is
    wrapped first, as torchtitan does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    if model.cfg.activation_checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    for block, reshard in zip(model.blocks, model.cfg.resharded()):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model
