"""FSDP2 (torch.distributed.fsdp.fully_shard) with AllGather and ReduceScatter overlapped in the
backward pass, through overcast or through the process group's own collectives."""

from overcast.fsdp.overlap import BACKENDS, Overlap, overlap, timed

__all__ = ["overlap", "timed", "Overlap", "BACKENDS"]
