"""FSDP2 (torch.distributed.fsdp.fully_shard) with AllGather and ReduceScatter overlapped in the
backward pass, through overcast or through the process group's own collectives."""

from overcast.fsdp.overlap import BACKENDS, Overlap, job_communicator, overlap, timed

__all__ = ["overlap", "job_communicator", "timed", "Overlap", "BACKENDS"]
