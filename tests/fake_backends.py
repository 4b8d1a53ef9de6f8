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
