"""NCCL communicators for the native call path: one per (process group, device), made once.

As vLLM's PyNccl does, the communicator is created through the user's own process group: rank 0
of the group draws a unique id, the group broadcasts it, and every rank joins with
``ncclCommInitRank``. NCCL itself is the libnccl.so.2 that the installed torch loaded (the
runtime object resolves it with dlopen), so the two never disagree on the NCCL version.
``FLASHOVERLAP_NCCL_LIBRARY`` names another library file to load when torch's is not loaded.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from flashoverlap_core.collectives import all_gather_single, reduce_scatter_single

from . import kernels
from .device_state import _current_stream_getter

ENV_LIBRARY = "FLASHOVERLAP_NCCL_LIBRARY"

_lock = threading.Lock()
_comms: dict = {}  # (group, device index, max CTAs or None) -> ncclComm_t (int)


def uses_nccl(group) -> bool:
    """Whether the process group's collectives on CUDA tensors go through NCCL."""
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return False


def library_path() -> str | None:
    """A libnccl.so.2 to load when the process has none loaded yet: the environment's choice,
    else the one of the nvidia-nccl wheel next to torch."""
    if os.environ.get(ENV_LIBRARY):
        return os.environ[ENV_LIBRARY]
    site = Path(torch.__file__).resolve().parents[1]
    for candidate in sorted(site.glob("nvidia/nccl/lib/libnccl.so*")):
        return str(candidate)
    return None


def version() -> int:
    """NCCL's version code (e.g. 22809 for 2.28.9), loading NCCL if needed."""
    runtime = kernels.runtime_library()
    runtime.nccl_load(library_path())
    return runtime.nccl_version()


def communicator(group, device: torch.device, max_ctas: int | None = None) -> int:
    """This rank's ncclComm_t for ``group`` on ``device``, created on first use (a collective:
    every rank of the group must ask, in the same order, as for any collective). With
    ``max_ctas``, a communicator of its own whose kernels take at most that many CTAs and no
    CTA clusters (allgather's: its kernels must fit on the SMs its waiting GEMM leaves free)."""
    key = (group, device.index, max_ctas)
    with _lock:
        comm = _comms.get(key)
        if comm is not None:
            return comm
        runtime = kernels.runtime_library()
        runtime.nccl_load(library_path())
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        uid = torch.zeros(128, dtype=torch.uint8)
        if rank == 0:
            uid = torch.frombuffer(bytearray(runtime.nccl_unique_id()), dtype=torch.uint8)
        on_device = uid.to(device)
        dist.broadcast(on_device, src=dist.get_global_rank(group, 0), group=group)
        comm = runtime.nccl_comm_init(world, bytes(on_device.cpu().numpy()), rank, device.index,
                                      max_ctas)
        _comms[key] = comm
        return comm


# ncclDataType_t of the dtypes the plain path moves (fp8 gathers as its bytes: uint8)
_NCCL_TYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
               torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_ALL_REDUCE, _REDUCE_SCATTER, _ALL_GATHER = 1, 2, 3


class PlainCollectives:
    """The plain path's collectives (``Backend.plain_collectives``) on this rank's communicator
    of the group: one NCCL call through the runtime (a few microseconds of host time, where
    torch.distributed's path costs tens), on the current stream, so ordered as the caller's own
    work. A tensor NCCL cannot take as it is (not contiguous, another dtype) goes through
    torch.distributed on the same group."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.comm = communicator(group, device)
        self.runtime = kernels.runtime_library()
        self.world = dist.get_world_size(group)
        self.stream = _current_stream_getter()

    def _native(self, *tensors) -> bool:
        return all(t.is_contiguous() and t.dtype in _NCCL_TYPES for t in tensors)

    def _run(self, kind: int, send: torch.Tensor, recv: torch.Tensor, count: int) -> None:
        self.runtime.nccl_collective(self.comm, kind, send.data_ptr(), recv.data_ptr(), count,
                                     _NCCL_TYPES[send.dtype], self.stream(send.device.index))

    def all_reduce(self, t: torch.Tensor) -> None:
        if self._native(t):
            self._run(_ALL_REDUCE, t, t, t.numel())
        else:
            dist.all_reduce(t, group=self.group)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if self._native(out, t) and out.dtype == t.dtype and t.numel() == out.numel() * self.world:
            self._run(_REDUCE_SCATTER, t, out, out.numel())
        else:
            reduce_scatter_single(out, t, group=self.group)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if self._native(out, t) and out.dtype == t.dtype and out.numel() == t.numel() * self.world:
            self._run(_ALL_GATHER, t, out, t.numel())
        else:
            all_gather_single(out, t, group=self.group)

