"""The ``ascend`` backend: the decomposition strategy on torch_npu streams, HCCL through
torch.distributed, and a device-side wait through CANN's ``aclrtValueWait`` behind an option.

No AscendC/catlass signaling GEMM yet (it needs the CANN compiler; its design is in
README.md): per group, the NPU's own matmul computes the group's tiles into the packed layout
on the compute stream, and the group's collective follows on a communication stream once the
group's signal (an event, or with ``wait="value"`` a counter value) is there.
"""
from __future__ import annotations

import threading

import torch

from flashoverlap_core.backend import OverlapCall, OverlapSpec
from flashoverlap_core.decomposition import DecompositionBackend, EventSignals, HostStreams

from . import environment
from .acl import AclUnavailable, AclValueOps, MonotonicCounter, ValueSignals
from .options import parse_wait_mode, wait_mode_from_env


class AscendBackend(DecompositionBackend):
    """``AscendBackend(wait=None)``: ``wait`` is ``"event"`` or ``"value"`` (see options.py);
    None reads FLASHOVERLAP_ASCEND_WAIT, default ``"event"``."""

    name = "ascend"
    device_type = "npu"
    priority = 50  # the only NPU backend; below cuda's signaling kernels where both exist

    def __init__(self, wait: str | None = None):
        self.wait = parse_wait_mode(wait) if wait is not None else wait_mode_from_env()
        self._acl: AclValueOps | None = None
        self._acl_error: str | None = None
        self._counters: dict = {}
        self._lock = threading.Lock()

    # ---- discovery ---------------------------------------------------------------------------
    def probe(self) -> str | None:
        return environment.probe_reason()

    def device_count(self) -> int:
        return environment.device_count()

    def versions(self) -> dict[str, str]:
        return environment.versions()

    def unsupported_reasons(self, spec: OverlapSpec) -> list[str]:
        if self.wait == "value" and self.value_ops() is None:
            return [self._acl_error]
        return []

    # ---- the device-side wait ------------------------------------------------------------------
    def value_ops(self) -> AclValueOps | None:
        """The CANN value write/wait functions, looked up once; None (and the reason kept)
        when this CANN lacks them."""
        with self._lock:
            if self._acl is None and self._acl_error is None:
                try:
                    self._acl = AclValueOps()
                except AclUnavailable as e:
                    self._acl_error = str(e)
            return self._acl

    def _counter(self, streams) -> MonotonicCounter:
        """One counter per compute stream: the values one stream writes arrive in order."""
        key = (streams.compute.device, streams.compute.npu_stream)
        with self._lock:
            counter = self._counters.get(key)
            if counter is None:
                tensor = torch.zeros(1, dtype=torch.int64, device=streams.compute.device)
                streams.compute.synchronize()  # zero before any wait can read it
                counter = self._counters[key] = MonotonicCounter(tensor)
            return counter

    def signals(self, streams: HostStreams, call: OverlapCall):
        if self.wait == "event":
            return EventSignals(streams)
        ops = self.value_ops()
        if ops is None:
            raise AclUnavailable(self._acl_error)
        return ValueSignals(streams, ops, self._counter(streams), call.plan.num_groups)
