"""Temporary alias: custom transfers moved to :mod:`flashoverlap_core.transfers`. Removed once
every importer uses the new path."""
from .transfers import HostOffload

__all__ = ["HostOffload"]
