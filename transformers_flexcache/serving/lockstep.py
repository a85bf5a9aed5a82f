"""Tensor parallelism: every rank of a sharded model runs the same engine steps, as rank 0 decides them.

A model loaded with transformers' `tp_plan` under `torchrun` runs collectives inside its forwards, so every rank
must run the same forwards in the same order. Rank 0 takes the requests and decides each step (`StepPlan`: the
requests admitted with their seats, the running ones that stop, or the end) and broadcasts it before the step; the
other ranks run the same requests on the same seats. Everything else a step does follows from the plan and the
model's outputs, which are equal on every rank, so the ranks stay in step. An idle rank 0 sends an empty plan every
`HEARTBEAT_S` seconds, so that the others' wait does not time out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .handle import RequestHandle
from .worker import RequestSpec

HEARTBEAT_S = 5.0


@dataclass
class StepPlan:
    """What one scheduler step does: the requests admitted (`(spec, seats)`), the running ones that stop
    (`request_id -> "cancelled" | "closed"`), or the end."""

    admitted: list = field(default_factory=list)
    stops: dict = field(default_factory=dict)
    exit: bool = False


def tensor_parallel_rank(model) -> int | None:
    """This process's rank when `model` is sharded with a `tp_plan` over several processes, else None.

    Raises:
        ValueError: the tensor-parallel group is not the whole world (data-parallel replicas beside it).
    """
    if (getattr(model, "tp_size", None) or 1) <= 1:
        return None
    import torch.distributed as dist

    if dist.get_world_size() != model.tp_size:
        raise ValueError(
            f"the engine steps every rank of a tensor-parallel model together and takes rank 0's requests: it needs "
            f"the model sharded over the whole world (tp_size={model.tp_size}, world size {dist.get_world_size()}); "
            "run one engine per tensor-parallel group in processes of their own"
        )
    return dist.get_rank()


def share(plan: StepPlan | None, *, leader: bool) -> StepPlan:
    """Rank 0's `plan` on every rank (others pass None): their specs get handles of their own, which nobody reads."""
    import torch.distributed as dist

    message = [None]
    if leader:
        message[0] = (
            [(spec.handle.request_id, spec.wire(), seats) for spec, seats in plan.admitted],
            plan.stops,
            plan.exit,
        )
    dist.broadcast_object_list(message, src=0)
    if leader:
        return plan
    admitted, stops, exit_ = message[0]
    specs = [
        (
            RequestSpec.from_wire(
                wire, handle=RequestHandle(request_id=request_id, num_seats=len(seats), on_cancel=_ignore)
            ),
            seats,
        )
        for request_id, wire, seats in admitted
    ]
    return StepPlan(admitted=specs, stops=stops, exit=exit_)


def _ignore(handle) -> None:
    return None
