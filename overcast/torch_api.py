"""The parts of torch overcast uses that differ between the torch versions it supports (2.11 to
2.15): FSDP2's private state and the torch.distributed names that moved. Nothing else in overcast
reaches into FSDP2's internals; every difference is found by looking for the capability, never by
reading a version string, so a torch that gains or loses one changes this file alone.

FSDP2's public API comes first wherever it has what overcast needs: `set_custom_all_gather`,
`set_custom_reduce_scatter`, the `AllGather`/`ReduceScatter` interfaces, the prefetch setters.
What it has no public face for (which parameter groups a module has, how FSDP2 will use a
ReduceScatter's output, asynchronous unshard) is read here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_api, _fsdp_common

from overcast.errors import TorchFeatureError

RedOpType = dist.ReduceOp.RedOpType
# FSDP2's custom-collective interfaces, and whether autograd is running a backward pass now
AllGather = _fsdp_api.AllGather
ReduceScatter = _fsdp_api.ReduceScatter
is_bw = _fsdp_common.is_bw


# -- torch.distributed ------------------------------------------------------------------------
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor, keeping the old names as
# deprecated aliases; 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def live_process_groups():
    """Every process group alive in this process (destroy_process_group() removes them)."""
    return dist.distributed_c10d._world.pg_map


def premul_sum(factor: float) -> dist.ReduceOp:
    """ReduceOp.PREMUL_SUM scaling by `factor`: `ReduceOp.PREMUL_SUM(factor)` where the enum
    value is callable (torch 2.13 on), `_make_nccl_premul_sum(factor)` before."""
    if callable(dist.ReduceOp.PREMUL_SUM):
        return dist.ReduceOp.PREMUL_SUM(factor)
    return dist._make_nccl_premul_sum(factor)


def premul_factor(op):
    """The factor a ReduceOp.PREMUL_SUM scales by (a number or a tensor); None for another op.
    torch 2.11 keeps it out of the op's attributes, but its pickled state has it."""
    if getattr(op, "op", op) != dist.ReduceOp.PREMUL_SUM:
        return None
    if hasattr(op, "factor"):
        return op.factor
    state: tuple = op.__getstate__() if hasattr(op, "__getstate__") else ()
    if len(state) != 2 or state[1] is None:
        raise TorchFeatureError(
            "this torch does not say which factor a ReduceOp.PREMUL_SUM "
            "scales by; overcast needs torch 2.11 or newer"
        )
    return state[1]


# -- FSDP2 ------------------------------------------------------------------------------------
def param_groups(module) -> list:
    """An FSDPModule's parameter groups (FSDPParamGroup): a list in torch 2.13 on, at most one
    before."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = state._fsdp_param_group
    return [] if one is None else [one]


def collectives(group) -> tuple:
    """The AllGather and ReduceScatter objects a parameter group calls now (FSDP2's defaults
    unless set_custom_* replaced them), to give back later."""
    return group._all_gather_comm, group._reduce_scatter_comm


def reduce_scatter_input_buffers(group) -> int:
    """How many ReduceScatter inputs FSDP2 keeps alive at once across the backward pass:
    `set_reduce_scatter_max_input_buffers` (torch 2.13 on, 1 by default); one before."""
    return getattr(group.comm_ctx, "reduce_scatter_max_input_buffers", 1)


def own_reduce_scatter_group(group) -> dist.ProcessGroup | None:
    """The ReduceScatter process group the user gave a parameter group apart from its shard
    group (`set_separate_reduce_scatter_group`, torch 2.13 on), or None."""
    return getattr(group.mesh_info, "reduce_scatter_process_group", None)


def shard_process_group(group) -> dist.ProcessGroup:
    """The process group a parameter group's parameters are sharded over (HSDP: this rank's
    replica's)."""
    return group.mesh_info.shard_process_group


def reshards_to_a_subgroup(group) -> bool:
    """Whether the group reshards to a smaller group after forward (reshard_after_forward=int),
    so that its backward AllGathers run on another process group."""
    return bool(group._use_post_forward_mesh)


def reduces_gradients(groups) -> bool:
    """Whether these parameter groups reduce their gradients in this backward pass (off in a
    micro-step with gradient sync off)."""
    return all(group.reduce_grads for group in groups)


def wire_dtypes(group) -> tuple[set, set]:
    """The dtypes FSDP2 may hand the collectives for a parameter group: (gathered, reduced).
    Parameters are gathered in their dtype (the mixed-precision param_dtype for floating point;
    several dtypes travel as bytes). Gradients of the parameters that have them are reduced in
    reduce_dtype or, without one, in the gathered dtype (up to torch 2.14) or the gradient's own
    (2.15 on): both are counted, whichever this torch picks. The policy is each parameter's
    (2.15 resolves one per parameter; before, each holds its module's)."""
    gathered, reduced = set(), set()
    for p in group.fsdp_params:
        policy, param = p.mp_policy, p.sharded_param
        dtype = (
            policy.param_dtype
            if policy.param_dtype and param.dtype.is_floating_point
            else param.dtype
        )
        gathered.add(dtype)
        if param.requires_grad:
            reduced |= (
                {policy.reduce_dtype}
                if policy.reduce_dtype
                else {dtype, getattr(param, "grad_dtype", None) or param.dtype}
            )
    return gathered, reduced


def _casts_after_reduction(group, output: torch.Tensor) -> bool:
    """Whether FSDP2 casts the reduced gradients to another dtype: to the group's one original
    dtype up to torch 2.14, to each parameter's gradient dtype from 2.15."""
    if hasattr(group, "_orig_dtype"):
        return group._orig_dtype != output.dtype
    return any(
        getattr(p, "sharded_grad_dtype", None) not in (None, output.dtype)
        for p in group.fsdp_params
    )


def output_unread(groups: list, output: torch.Tensor, op) -> bool:
    """Whether FSDP2's foreach_reduce (torch 2.11 to 2.15 alike, but for the cast) leaves a
    ReduceScatter's output unread until the backward pass ends: it only makes the sharded
    gradients views of it. It reads it at once to divide after the reduction (its op is then SUM,
    not AVG or PREMUL_SUM), to cast to the parameters' dtype, to all-reduce it (HSDP, an
    all-reduce hook), to add it to gradients already there (accumulating), or for a
    post-accumulate-grad hook or CPU offload."""
    if getattr(op, "op", op) == dist.ReduceOp.SUM:
        return False
    for group in groups:
        if (
            isinstance(group.mesh_info, _fsdp_common.DDPMeshInfo)
            or group._all_reduce_hook is not None
            or _casts_after_reduction(group, output)
        ):
            return False
        for p in group.fsdp_params:
            param = p.sharded_param
            if (
                param.grad is not None
                or p.offload_to_cpu
                or getattr(param, "_post_accumulate_grad_hooks", None)
            ):
                return False
    return True


def schedule(modules) -> dict:
    """What overlap() changes of FSDP2's schedule, per FSDPModule (of (name, module) pairs):
    whether each parameter group unshards asynchronously, and the modules it prefetches."""
    saved = {}
    for _, module in modules:
        state = module._get_fsdp_state()
        saved[module] = (
            [g.unshard_async_op for g in param_groups(module)],
            list(state._states_to_forward_prefetch),
            list(state._states_to_backward_prefetch),
        )
    return saved


def restore_schedule(saved: dict) -> None:
    """Put back what schedule() saved."""
    for module, (async_ops, forward, backward) in saved.items():
        for group, async_op in zip(param_groups(module), async_ops):
            group.unshard_async_op = async_op
        state = module._get_fsdp_state()
        state._states_to_forward_prefetch = list(forward)
        state._states_to_backward_prefetch = list(backward)


def set_unshard_async_op(model, async_op: bool) -> None:
    """Unshard asynchronously in the pre-forward and pre-backward hooks (so an explicitly
    prefetched AllGather runs beside compute), on `model` and every FSDPModule in it."""
    model._set_unshard_async_op(async_op)
