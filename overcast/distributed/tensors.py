"""What a torch call's tensors and options become for overcast: its reduce op, a tensor's bytes
or reducible array, a contiguous stand-in, and a method's CUDA tensors staged through host
memory (overcast/staging.py) for the backend's collectives (overcast/distributed/backend.py).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overcast.buffers import DTYPES, as_array
from overcast.distributed.calls import mapped
from overcast.errors import InvalidArgumentError
from overcast.staging import Staging, device_of, process_pool
from overcast.torch_api import premul_factor

# torch's reduce ops as overcast's; PREMUL_SUM is a sum of inputs scaled first.
REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.PREMUL_SUM: "sum",
}


def reduce_op(op) -> tuple[str, Any]:
    """(overcast op, premultiplying factor or None) for a torch ReduceOp."""
    kind = getattr(op, "op", op)
    for torch_op, name in REDUCE_OPS.items():
        if kind == torch_op:
            return name, premul_factor(op)
    raise InvalidArgumentError(
        f"reduce op {kind} is not offered by overcast; supported: SUM, "
        f"AVG, PREMUL_SUM, MAX, MIN, PRODUCT"
    )


def op_of(opts) -> object:
    """The reduce op a call's options name (torch's default, SUM, when called without)."""
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


def root_of(opts) -> int:
    return 0 if opts is None else opts.rootRank


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a flat uint8 array, for collectives that only move data:
    every dtype goes (bool, complex, int16...)."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def reducible(t: torch.Tensor, op: str, what: str) -> np.ndarray:
    """A contiguous tensor as the array overcast reduces: complex numbers as pairs of reals,
    which sums and averages treat correctly and the other ops would not."""
    if t.is_complex():
        if op not in ("sum", "avg"):
            raise InvalidArgumentError(f"{what}: op {op} is not defined on complex tensors")
        t = torch.view_as_real(t)
    arr = as_array(t, what)
    if arr.dtype not in DTYPES:
        raise InvalidArgumentError(
            f"{what}: overcast cannot reduce {t.dtype}; supported: "
            f"float32, float64, float16, bfloat16, complex64, "
            f"complex128, int8, int32, int64, uint8"
        )
    return arr


@contextlib.contextmanager
def contiguous(t: torch.Tensor):
    """`t` itself if it is contiguous; otherwise a contiguous copy, written back after."""
    work = t if t.is_contiguous() else t.contiguous()
    yield work
    if work is not t:
        t.copy_(work)


def leaves(value) -> list[torch.Tensor]:
    """Every tensor in `value` (a tensor, or lists of them, or None)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in leaves(v)]
    return []


# What a collective does with each of its tensor arguments, in order: "in" is read, "out"
# written whole, "inout" read and written (or written on some ranks only: the copy in keeps
# the others' values).
ROLES = {
    "in": {"read": True, "written": False},
    "out": {"read": False, "written": True},
    "inout": {"read": True, "written": True},
}


def staged(*roles: str):
    """A collective method that takes CUDA tensors: its first len(roles) arguments are checked
    for their device and, on a GPU, replaced by staged host twins (see the module's doc). What
    raises here, before the call is queued, raises from the call and is refused to the other
    ranks in the call's place (ProcessGroupOvercast._refused)."""

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            given = args[: len(roles)]
            try:
                device = device_of(leaves(given), method.__name__)
            except Exception as err:
                self._refused(method.__name__, err)
                raise
            if device is None:
                return method(self, *args, **kwargs)
            staging = Staging(device, self._side_stream(device), process_pool())
            try:
                try:
                    host = [
                        mapped(a, lambda t, role=role: staging.twin(t, **ROLES[role]))
                        for a, role in zip(given, roles)
                    ]
                    staging.sealed()
                except Exception as err:
                    self._refused(method.__name__, err)
                    raise
                self._calling.staging = staging
                try:
                    return method(self, *host, *args[len(roles) :], **kwargs)
                finally:
                    self._calling.staging = None
            except BaseException:
                staging.release()
                raise

        return call

    return wrap


def one_tensor(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{what} takes one tensor, not {len(tensors)}")
    return tensors[0]
