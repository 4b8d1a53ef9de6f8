"""FlashOverlap: hide the collective communication of a GEMM's output behind the GEMM.

``overlap(a, b, op)`` returns ``op`` (allreduce, reduce_scatter, all_to_all, allgather, or a
callable) applied to ``a @ b`` across the process group, with each wave group's collective
started on the device as soon as the GEMM has written that group's tiles (for allgather: each
chunk of rows computed as soon as it has arrived). See docs/design.md.
"""
from . import api as _api
from .api import backends, forget_prepared, prepared_calls
from .faults import CommunicationError, check_group, set_timeout
from .planning import make_plan, plan
from .backend import Backend, OverlapCall, OverlapSpec, PreparedCall
from .plan import OPS, Plan, Region
from .registry import BackendError, BackendStatus, register
from .tiles import Schedule, TileRect
from .tuning.cache import lookup_plan as _lookup_plan
from .tuning.strategy import StrategyChoice as _StrategyChoice
from .planning import set_strategy as _set_strategy
from .torch_ops import overlap  # api.overlap, also as torch custom ops (compile, autograd)
from .torch_ops import overlap_add_rmsnorm  # the post-reorder fused into residual add + RMSNorm
from . import nn  # noqa: E402  tensor-parallel layers (fo.nn)

_api.set_plan_lookup(_lookup_plan)  # calls without plan= use tuned plans where the cache has them
_set_strategy(_StrategyChoice())  # ... and choose overlap or the plain path (tuning.strategy)

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "BackendStatus", "CommunicationError", "OPS", "check_group", "OverlapCall", "OverlapSpec", "Plan",
    "PreparedCall", "Region", "Schedule", "TileRect", "backends", "make_plan", "overlap",
    "forget_prepared", "overlap_add_rmsnorm", "plan",
    "prepared_calls", "register", "set_timeout",
]
