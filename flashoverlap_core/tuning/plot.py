"""Temporary alias: the timeline plot moved to :mod:`flashoverlap_core.tools.plot` (a tool).
Removed once bench/tuning.py imports the new path."""
from ..tools.plot import plot_timeline

__all__ = ["plot_timeline"]
