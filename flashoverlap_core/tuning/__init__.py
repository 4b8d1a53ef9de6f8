"""Wave-group tuning: how to cut the GEMM's tiles into groups so that the transfers hide best.

* :mod:`.trace` — :class:`TileTrace`, what ``Backend.trace(call)`` reports of one call;
* :mod:`.model` — the timing model (GEMM wave ends, transfer cost curve, contention) and its
  simulation of any grouping;
* :mod:`.search` — the predictive search (dynamic programming over wave boundaries) and the
  candidates of the measured, exhaustive one;
* :mod:`.measure` / :mod:`.tuner` — measuring the model on the caller's device and group;
* :mod:`.cache` — the JSON cache of tuned plans, and :func:`lookup_plan` for ``overlap``;
* :mod:`.tune_cli` / :mod:`.trace_cli` — ``flashoverlap tune`` and ``flashoverlap trace``.

Only the light modules are imported here: the API imports this package to look plans up.
"""
from .cache import TuningCache, lookup_plan
from .model import Contention, CostCurve, GemmTiming, OverlapModel
from .search import Choice, predictive_search
from .trace import TileTrace

__all__ = ["Choice", "Contention", "CostCurve", "GemmTiming", "OverlapModel", "TileTrace",
           "TuningCache", "lookup_plan",
           "predictive_search"]


def tune_main(argv=None) -> int:
    """``flashoverlap tune``; see :mod:`.tune_cli`."""
    from .tune_cli import tune_main as main
    return main(argv)


def trace_main(argv=None) -> int:
    """``flashoverlap trace``; see :mod:`.trace_cli`."""
    from .trace_cli import trace_main as main
    return main(argv)
