"""Wave-group tuning: how to cut the GEMM's tiles into groups so that the transfers hide best.

* :mod:`.model` — the timing model (GEMM wave ends, transfer cost curve, contention) and its
  simulation of any grouping, built from :class:`~flashoverlap_core.tile_trace.TileTrace`\\ s;
* :mod:`.search` — the predictive search (dynamic programming over wave boundaries) and the
  candidates of the measured, exhaustive one;
* :mod:`.measure` / :mod:`.tuner` — measuring the model on the caller's device and group;
* :mod:`.cache` — the JSON cache of tuned plans, and :func:`~.cache.lookup_plan`, which
  ``flashoverlap_core`` hands to the API (``api.set_plan_lookup``) so that ``overlap`` uses
  tuned plans without the API importing this package.

Tuning sits above the API and the backends and below the tools: ``flashoverlap tune`` and
``flashoverlap trace`` live in :mod:`flashoverlap_core.tools`.
"""
from .cache import TuningCache, lookup_plan
from .model import Contention, CostCurve, GemmTiming, OverlapModel
from .search import Choice, predictive_search

__all__ = ["Choice", "Contention", "CostCurve", "GemmTiming", "OverlapModel", "TuningCache",
           "lookup_plan", "predictive_search"]
