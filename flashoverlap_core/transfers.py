"""Custom transfers for ``overlap(a, b, op=callable)``.

A custom op is called as ``op(region, index)`` once per group, in group order, after the
device-side wait, with the communication stream current. ``HostOffload`` is a real one: it
copies each finished group to pinned host memory as soon as the GEMM has written it, so the
device-to-host copies overlap the rest of the GEMM (one GPU, copy engines).
"""
from __future__ import annotations

import torch


class HostOffload:
    """Copy every group's region into a pinned host buffer of the packed layout.

    After the call (and a sync of the stream it ran on), ``host`` holds the packed output;
    ``Plan.packed_index()`` / the plan's post-reorder maps it back to row-major.
    """

    def __init__(self, numel: int, dtype: torch.dtype, pin_memory: bool = True):
        if numel < 1:
            raise ValueError(f"HostOffload needs a buffer of >= 1 element, got {numel}")
        self.host = torch.empty(numel, dtype=dtype, pin_memory=pin_memory)
        self.offset = 0

    @classmethod
    def for_plan(cls, plan, pin_memory: bool = True) -> "HostOffload":
        return cls(plan.packed_numel, plan.torch_dtype, pin_memory)

    def __call__(self, region: torch.Tensor, index: int) -> None:
        if index == 0:
            self.offset = 0
        end = self.offset + region.numel()
        if end > self.host.numel():
            raise ValueError(f"HostOffload buffer of {self.host.numel()} elements is too small "
                             f"for group {index} ending at element {end}")
        self.host[self.offset:end].copy_(region, non_blocking=True)
        self.offset = end
