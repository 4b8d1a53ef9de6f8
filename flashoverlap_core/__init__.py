"""FlashOverlap: hide the collective communication of a GEMM's output behind the GEMM.

``overlap(a, b, op)`` returns ``op`` (allreduce, reduce_scatter, all_to_all, or a callable)
applied to ``a @ b`` across the process group, with each wave group's collective started on the
device as soon as the GEMM has written that group's tiles. See DESIGN.md.
"""
from .api import backends, make_plan, overlap, plan
from .backend import Backend, OverlapCall, OverlapSpec
from .plan import OPS, Plan, Region
from .registry import BackendError, BackendStatus, register
from .tiles import Schedule, TileRect

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "BackendStatus", "OPS", "OverlapCall", "OverlapSpec", "Plan",
    "Region", "Schedule", "TileRect", "backends", "make_plan", "overlap", "plan", "register",
]
