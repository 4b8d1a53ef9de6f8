"""Temporary alias: the trace type moved down to :mod:`flashoverlap_core.tile_trace` (the
backend contract uses it). Removed once every importer uses the new path."""
from ..tile_trace import FORMAT, HostRecorder, NoRecorder, TileTrace

__all__ = ["FORMAT", "HostRecorder", "NoRecorder", "TileTrace"]
