"""What `overcast train` may be asked: the model's shape (GPTConfig, and the named SHAPES), the
ways to train it, and the check of a whole request. No torch here, so a bad flag is named before
torch loads."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TypedDict

from overcast.limits import check_hosts, check_link_rate

# --reshard's names: (block, blocks) -> whether that block reshards after forward
RESHARD = {
    "all-but-last": lambda i, n: i < n - 1,  # torchtitan's: backward needs the last block at once
    "all": lambda i, n: True,
    "none": lambda i, n: False,
}


class ShapeChanges(TypedDict, total=False):
    """What a named shape changes of GPTConfig's defaults."""

    vocab: int
    dim: int
    blocks: int
    seq: int
    batch_per_rank: int
    reshard: str


# `overcast train --shapes`: each shape's changes to the defaults, small to communication-heavy
SHAPES: dict[str, ShapeChanges] = {
    "small": {"vocab": 256, "dim": 128, "blocks": 2},  # little to move: latency shows
    "default": {},
    "long": {"seq": 256, "batch_per_rank": 8},  # the default's weights, 8x the compute
    "deep": {"vocab": 4096, "blocks": 8, "reshard": "all"},  # more blocks, a wide vocabulary
    "wide": {"dim": 512},  # 4x the bytes per block
    "kept": {"reshard": "none"},  # no block gathers in backward: no pair
}


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    dim: int = 256
    heads: int = 4
    blocks: int = 4
    seq: int = 64
    batch_per_rank: int = 4
    seed: int = 0
    micro_steps: int = 1  # gradient accumulation: batches per optimizer step
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    reshard: str = "all-but-last"  # which blocks free their parameters after forward

    def as_dict(self) -> dict:
        return asdict(self)

    def resharded(self) -> list[bool]:
        """Per block, whether it reshards after forward (and so gathers again in backward)."""
        if self.reshard in RESHARD:
            return [RESHARD[self.reshard](i, self.blocks) for i in range(self.blocks)]
        try:
            chosen = {int(x) for x in self.reshard.split(",") if x.strip()}
        except ValueError:
            chosen = None
        if chosen is None or not chosen <= set(range(self.blocks)):
            raise ValueError(
                f"--reshard takes {', '.join(RESHARD)} or block numbers from 0 to "
                f"{self.blocks - 1}, comma-separated; not {self.reshard!r}"
            )
        return [i in chosen for i in range(self.blocks)]

    def block_parameters(self) -> int:
        return 12 * self.dim * self.dim + 13 * self.dim  # attention 4d^2+4d, MLP 8d^2+5d, norms 4d

    def parameters(self) -> int:
        """The whole model's: embeddings, blocks, final norm and head."""
        return (
            (self.vocab + self.seq) * self.dim
            + self.blocks * self.block_parameters()
            + 2 * self.dim
            + self.dim * self.vocab
        )


# (description, how overcast.fsdp configures the model) of each way, in report order.
WAYS = {
    "gloo": "gloo, one process group (FSDP2's defaults)",
    "gloo-separate": "gloo, ReduceScatter on its own group, same prefetch as overcast",
    "overcast-ring": "overcast rings for AllGather and ReduceScatter",
    "overcast": "overcast multicast AllGather + in-network ReduceScatter (forward AllGathers on "
    "its ring)",
}
# The ways whose collectives run on an overcast Communicator (and so can be traced).
OVERCAST_WAYS = ("overcast-ring", "overcast")


DEVICES = ("cpu", "cuda")


def check_request(
    ways: list[str],
    hosts: int,
    steps: int,
    warmup: int,
    link_bits: float = 1e8,
    cfg: GPTConfig = GPTConfig(),
    lr: float = 1e-3,
    prefetch: int = 1,
    device: str = "cpu",
) -> None:
    """Raise ValueError naming what is wrong, before any cluster is built (or CUDA touched:
    the hosts are forked)."""
    unknown = [w for w in ways if w not in WAYS]
    if unknown or not ways:
        raise ValueError(
            f"unknown way {', '.join(unknown) or '(none)'}; available: {', '.join(WAYS)}"
        )
    check_hosts(hosts)
    if warmup < 0 or steps <= warmup:
        raise ValueError(
            f"--steps ({steps}) must be more than --warmup ({warmup}), which must be 0 or more"
        )
    check_link_rate(link_bits)
    if min(cfg.blocks, cfg.batch_per_rank, cfg.micro_steps, cfg.seq) < 1 or cfg.vocab < 2:
        raise ValueError(
            f"--blocks ({cfg.blocks}), --batch ({cfg.batch_per_rank}), --seq "
            f"({cfg.seq}) and --micro-steps ({cfg.micro_steps}) must be 1 or more, "
            f"--vocab ({cfg.vocab}) 2 or more"
        )
    cfg.resharded()  # names what is wrong with --reshard
    if cfg.dim < cfg.heads or cfg.dim % cfg.heads:
        raise ValueError(
            f"--dim must be a positive multiple of {cfg.heads} (the attention heads), not {cfg.dim}"
        )
    if not lr > 0:
        raise ValueError(f"--lr must be above 0, not {lr:g}")
    if prefetch < 1:
        raise ValueError(f"--prefetch must be 1 or more blocks, not {prefetch}")
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device == "cuda" and not cuda_visible():
        raise ValueError("--device cuda: no CUDA GPU is visible here (torch.cuda reports none)")


def cuda_visible() -> bool:
    """Whether torch sees a CUDA GPU, asked through NVML so that CUDA is not initialized in
    this process (its forked children could not use it then)."""
    import os

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()
