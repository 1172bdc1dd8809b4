"""User buffers as flat numpy views, the dtypes overcast reduces, and the reduction itself.

numpy arrays and contiguous CPU torch tensors are both accepted; a tensor is viewed through numpy
without a copy (bfloat16 through ml_dtypes, since numpy has no bfloat16 of its own).
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from overcast.errors import InvalidArgumentError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {
    np.dtype(t) for t in ("float32", "float64", "float16", "int32", "int64", "uint8", "int8")
} | {BFLOAT16}
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
# What the aggregator computes: in-network reduction sums (and averages) only.
SUMMING_OPS = ("sum", "avg")
_UFUNCS = {
    "sum": np.add,
    "avg": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "product": np.multiply,
}


def as_array(buf, what: str) -> np.ndarray:
    """A flat, writable numpy view of `buf` (numpy array or CPU torch tensor), never a copy."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise InvalidArgumentError(
                f"{what} is on {buf.device}; a Communicator moves host "
                f"memory (the torch.distributed backend and overlap() "
                f"stage CUDA tensors through it)"
            )
        if not buf.is_contiguous():
            raise InvalidArgumentError(
                f"{what} is not contiguous (shape {tuple(buf.shape)}, "
                f"stride "
                f"{buf.stride()}); call .contiguous() first"
            )
        flat = buf.detach().reshape(-1)
        if flat.dtype == torch.bfloat16:
            return flat.view(torch.int16).numpy().view(BFLOAT16)
        try:
            return flat.numpy()
        except TypeError as err:
            raise InvalidArgumentError(f"{what} has unsupported dtype {buf.dtype}") from err
    if not isinstance(buf, np.ndarray):
        raise InvalidArgumentError(
            f"{what} must be a numpy array or a CPU torch tensor, not {type(buf).__name__}"
        )
    if not buf.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous (shape {buf.shape}, strides "
            f"{buf.strides}); use np.ascontiguousarray"
        )
    return buf.reshape(-1)


def check_dtype(arr: np.ndarray, what: str) -> None:
    if arr.dtype not in DTYPES:
        names = ", ".join(sorted(str(d) for d in DTYPES))
        raise InvalidArgumentError(f"{what} has unsupported dtype {arr.dtype}; supported: {names}")


_BY_CODE = tuple(sorted(DTYPES, key=str))
_CODES = {d: i for i, d in enumerate(_BY_CODE)}


def dtype_code(dtype: np.dtype) -> int:
    """A stable small integer naming the dtype on the wire."""
    return _CODES[np.dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype:
    if not 0 <= code < len(_BY_CODE):
        raise ValueError(f"unknown dtype code {code}")
    return _BY_CODE[code]


def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """Sums of 16-bit floats are computed in float32 and rounded once."""
    return np.dtype(np.float32) if dtype in (BFLOAT16, np.dtype(np.float16)) else dtype


def check_reduce(dtype: np.dtype, op: str) -> None:
    if op not in REDUCE_OPS:
        raise InvalidArgumentError(
            f"unsupported reduce op {op!r}; supported: {', '.join(REDUCE_OPS)}"
        )


def reduce_into(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: str) -> None:
    """out = a op b in the dtype of `out` ("avg" adds; divide_into finishes it), 16-bit floats
    computed in float32 and rounded once."""
    _UFUNCS[op](a, b, out=out, dtype=accumulator_dtype(out.dtype), casting="unsafe")


def divide_into(out: np.ndarray, world: int) -> None:
    """Turn a finished sum into an average, in place: integers (their sums wrapped) truncated
    toward zero, as NCCL averages them; floats divided in their accumulator's dtype."""
    if out.dtype.kind in "iu":
        # numpy's floor division, then one up where a negative sum did not divide evenly
        inexact = np.remainder(out, world) != 0
        np.floor_divide(out, world, out=out)
        if out.dtype.kind == "i":
            out += inexact & (out < 0)
        return
    np.divide(out, world, out=out, dtype=accumulator_dtype(out.dtype), casting="unsafe")
