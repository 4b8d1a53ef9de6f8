"""Small stand-in backends for the registry and suite-selection tests (not broken: just unusual)."""
from __future__ import annotations

from flashoverlap_core.reference import ReferenceBackend


class Recording(ReferenceBackend):
    """The reference backend under another name, counting its runs."""

    name = "fake-recording"
    priority = -5
    runs = 0

    def run(self, call):
        type(self).runs += 1
        return super().run(call)


class Unavailable(ReferenceBackend):
    """Known, but its hardware is missing here."""

    name = "fake-unavailable"
    device_type = "cpu"
    priority = 10

    def probe(self):
        return "no frobnicator device found (fake backend for tests)"


class FewDevices(ReferenceBackend):
    """An accelerator backend that sees a single device."""

    name = "fake-one-device"
    device_type = "fakedev"

    def device_count(self):
        return 1


class FixedTiles(ReferenceBackend):
    """Kernels for two tiles only, like an accelerator backend: the suite's small tiles are
    refused, and its cases ask for the tile this backend declares instead."""

    name = "fake-fixed-tiles"
    TILES = ((8, 8), (16, 8))

    def default_tile(self, spec):
        return self.TILES[0]

    def plan_reasons(self, plan):
        if tuple(plan.tile) in self.TILES:
            return []
        return [f"no kernel for tile {tuple(plan.tile)} (fake backend: {list(self.TILES)})"]


class NoTileFits(FixedTiles):
    """Declares a default tile it has no kernel for: its tile cases must skip, saying why."""

    name = "fake-no-tile-fits"

    def default_tile(self, spec):
        return (4, 4)


class NoAllgather(ReferenceBackend):
    """Declines allgather, as a backend whose GEMM only signals finished tiles does."""

    name = "fake-no-allgather"

    def unsupported_reasons(self, spec):
        return ["no GEMM that waits for rows (fake backend)"] if spec.op == "allgather" else []
