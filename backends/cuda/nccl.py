"""NCCL communicators for the native call path: one per (process group, device), made once.

As vLLM's PyNccl does, the communicator is created through the user's own process group: rank 0
of the group draws a unique id, the group broadcasts it, and every rank joins with
``ncclCommInitRank``. NCCL itself is the libnccl.so.2 that the installed torch loaded (the
runtime object resolves it with dlopen), so the two never disagree on the NCCL version.
``FLASHOVERLAP_NCCL_LIBRARY`` names another library file to load when torch's is not loaded.

Each communicator made here comes with a twin for captured work (``capture_twin``): what the
runtime queues on a stream being captured (the call path's own graphs, a caller's capture) goes
to the twin, so that neither communicator runs both graph replays and eager calls. NCCL 2.28
does not keep one rank's network work in order on a communicator used both ways (csrc/cuda/nccl.cu
says when), and the ranks' sends and receives then stop pairing up (docs/design.md, "The call
path"). ``FLASHOVERLAP_NCCL_CAPTURE_COMM=0`` on rank 0 of a group makes one communicator do both
for that group, as before.

Every communicator made here is watched (csrc/cuda/nccl.cu, "The watchdog"; docs/design.md,
"Failure model"): its creation has a deadline, and everything queued on it is followed against
the deadline (``flashoverlap_core.faults.timeout``: the group's timeout unless
``FLASHOVERLAP_TIMEOUT`` or ``fo.set_timeout`` say otherwise). On a timeout or an asynchronous
NCCL error the runtime aborts every communicator of the group, and what follows is torch's
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` where it is set (1: abort, then tear the process down; 3:
tear it down; 0 and 2: abort), else the next call raises ``fo.CommunicationError``. A failed
communicator is never made again for its group until ``fo.forget_prepared()``.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from flashoverlap_core.collectives import all_gather_single, reduce_scatter_single
from flashoverlap_core import faults

from . import kernels
from .device_state import _current_stream_getter

ENV_LIBRARY = "FLASHOVERLAP_NCCL_LIBRARY"
ENV_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ENV_WATCHDOG = "FLASHOVERLAP_WATCHDOG"
ENV_CAPTURE_COMM = "FLASHOVERLAP_NCCL_CAPTURE_COMM"
# TORCH_NCCL_ASYNC_ERROR_HANDLING -> fo_nccl_watch's handling (0 report and raise at the next
# call, 1 abort then tear down, 2 tear down without abort); unset: report and raise.
HANDLING = {"0": 0, "1": 1, "2": 0, "3": 2}
WATCH_STATES = {1: "timed out", 2: "NCCL error", 3: "another communicator of the group failed",
                4: "aborted", 5: "device error"}  # FO_WATCH_* of flashoverlap_cuda.h

_lock = threading.Lock()
_comms: dict = {}  # (group, device index, max CTAs or None) -> ncclComm_t (int)
_watches: dict = {}  # ncclComm_t -> (group, key in _comms, watch handle)
_group_ids: dict = {}  # group -> the id its watches share (they fail together)
_next_id = itertools.count(1)


def error_handling() -> int:
    """The watch's ``handling`` from ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (unset: 0)."""
    value = os.environ.get(ENV_ERROR_HANDLING, "").strip()
    if value == "":
        return 0
    if value not in HANDLING:
        raise ValueError(f"{ENV_ERROR_HANDLING} must be 0, 1, 2 or 3, got {value!r}")
    return HANDLING[value]


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


def watchdog_enabled() -> bool:
    """Whether FlashOverlap's communicators are made under a deadline and watched: on by
    default, ``FLASHOVERLAP_WATCHDOG=0`` turns it off. Its cost per call is within noise on the
    H200. (It was off by default while an all_to_all conformance case failed only with it on; on
    2026-12-03 the same case hung with it off, so the watchdog was not the cause but what turned
    a hang into an error: docs/design.md, "Failure model".) Off, a communicator is made and used
    as before the watchdog (the guarded NCCL entry points pass straight through for an unwatched
    one), and a dead peer can hang the survivors."""
    return _switch(ENV_WATCHDOG)


def capture_twin() -> bool:
    """Whether each communicator gets a twin for the work queued while a stream is captured (on
    by default; ``FLASHOVERLAP_NCCL_CAPTURE_COMM=0``: one communicator for both, which NCCL
    2.28 may run out of order between ranks). Rank 0's answer decides for its group."""
    return _switch(ENV_CAPTURE_COMM)


def _switch(name: str) -> bool:
    """An on/off variable that is on by default: "0" or "1" (empty: the default)."""
    value = os.environ.get(name, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def communicator(group, device: torch.device, max_ctas: int | None = None) -> int:
    """This rank's ncclComm_t for ``group`` on ``device``, created on first use (a collective:
    every rank of the group must ask, in the same order, as for any collective). With
    ``max_ctas``, a communicator of its own whose kernels take at most that many CTAs and no
    CTA clusters (allgather's: its kernels must fit on the SMs its waiting GEMM leaves free).
    Its capture twin (:func:`capture_twin`) is made with it, from the same broadcast."""
    key = (group, device.index, max_ctas)
    with _lock:
        comm = _comms.get(key)
        if comm is not None:
            return comm
        faults.check(group, None)  # a failed group gets no new communicator
        runtime = kernels.runtime_library()
        runtime.nccl_load(library_path())
        handling = error_handling()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        seconds = faults.timeout(group, "cuda")

        def create():  # -> (communicator, its capture twin or 0)
            # rank 0's choice of a twin travels with the ids (byte 0), so that the ranks of a
            # group make the same communicators even where their environments differ
            with torch.cuda.device(device):
                uid = torch.zeros(1 + 2 * 128, dtype=torch.uint8)
                if rank == 0:
                    twin = capture_twin()
                    ids = bytes([twin]) + runtime.nccl_unique_id() + (
                        runtime.nccl_unique_id() if twin else bytes(128))
                    uid = torch.frombuffer(bytearray(ids), dtype=torch.uint8)
                on_device = uid.to(device)
                with faults.collective(group, "the broadcast of a new communicator's id"):
                    dist.broadcast(on_device, src=dist.get_global_rank(group, 0), group=group)
                    ids = bytes(on_device.cpu().numpy())
                count = 2 if ids[0] else 1
                made = [runtime.nccl_comm_init(world, ids[1 + 128 * i:1 + 128 * (i + 1)], rank,
                                               device.index, max_ctas) for i in range(count)]
                if count == 2:
                    runtime.nccl_set_capture_comm(made[0], made[1])
                return made[0], (made[1] if count == 2 else 0)

        if not watchdog_enabled():  # as before the watchdog: made here, not watched
            comm, _ = create()
            _comms[key] = comm
            return comm
        # ncclCommInitRank waits for every rank: past the deadline the creating thread is left
        # behind (it cannot be interrupted) and the group is failed.
        try:
            comm, twin = faults.call_with_deadline(create, seconds,
                                                   "making FlashOverlap's communicator")
        except TimeoutError as e:
            raise faults.record(group, faults.error(
                group, f"{e}: not every rank of the group joined (a rank died, stalled or did not "
                "make the same call)", timeout_s=seconds)) from None
        # the two fail together: one group id
        watch = runtime.nccl_watch(comm, device.index, _group_id(group), seconds, handling)
        if twin:
            twin_watch = runtime.nccl_watch(twin, device.index, _group_id(group), seconds, handling)
            _watches[twin] = (group, key + ("capture",), twin_watch)
        _comms[key] = comm
        _watches[comm] = (group, key, watch)
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
    torch.distributed on the same group. ``max_ctas``: on the communicator whose kernels take at
    most that many CTAs instead (the overlapped calls' one: what their collectives cost, to
    measure)."""

    def __init__(self, group, device: torch.device, max_ctas: int | None = None):
        self.group = group
        self.comm = communicator(group, device, max_ctas=max_ctas)
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

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, send_splits, recv_splits) -> None:
        """``t``'s rows to the ranks (``send_splits`` rows each, in rank order) and theirs into
        ``out`` (``recv_splits``), as ``all_to_all_single``: one NCCL group of send/receive
        pairs through the runtime."""
        row = math.prod(t.shape[1:])  # elements per row
        if (self._native(out, t) and out.dtype == t.dtype and t.dim() == out.dim()
                and t.shape[1:] == out.shape[1:] and len(send_splits) == len(recv_splits)
                == self.world and sum(send_splits) == t.shape[0]
                and sum(recv_splits) == out.shape[0]):
            self.runtime.nccl_all_to_all(
                self.comm, t.data_ptr(), [int(r) * row for r in send_splits], out.data_ptr(),
                [int(r) * row for r in recv_splits], _NCCL_TYPES[t.dtype], t.element_size(),
                self.stream(t.device.index))
        else:
            dist.all_to_all_single(out, t, output_split_sizes=list(recv_splits),
                                   input_split_sizes=list(send_splits), group=self.group)

def _group_id(group) -> int:
    if group not in _group_ids:
        _group_ids[group] = next(_next_id)
    return _group_ids[group]


def failure(comm) -> faults.CommunicationError | None:
    """The failure of the communicator ``comm`` (None when it is healthy or not ours), recorded
    as its group's."""
    entry = _watches.get(comm) if comm else None
    if entry is None:
        return None
    group, _, watch = entry
    state, nccl_error, waited_s, reason = kernels.runtime_library().nccl_watch_status(watch)
    if state == 0:
        return None
    found = faults.error(group, reason or WATCH_STATES.get(state, f"watch state {state}"),
                         elapsed_s=waited_s or None, timeout_s=faults.timeout(group, "cuda"))
    return faults.record(group, found)


def pending(comm) -> int:
    """Work queued on ``comm`` that the watchdog has not seen complete (for tests)."""
    entry = _watches.get(comm)
    return kernels.runtime_library().nccl_watch_pending(entry[2]) if entry else 0


def abort(comm, why: str = "aborted on request") -> None:
    """Fail ``comm``'s watch now, aborting it (its group's other communicators too)."""
    entry = _watches.get(comm)
    if entry is not None:
        kernels.runtime_library().nccl_watch_abort(entry[2], why)


def _probe(group):
    """faults' probe: the failure of any communicator of ``group``."""
    for comm, (owner, _, _) in list(_watches.items()):
        if owner is group:
            found = failure(comm)
            if found is not None:
                return found
    return None


def _forget(timeout_changed: bool = False) -> None:
    """faults' hook: new deadlines for every watch, or (fo.forget_prepared) drop the failed
    communicators, so that a call made after the recovery makes a new one."""
    runtime = kernels.runtime_library() if _watches else None
    with _lock:
        for comm, (group, key, watch) in list(_watches.items()):
            if timeout_changed:
                runtime.nccl_watch_set_timeout(watch, faults.timeout(group, "cuda"))
            elif runtime.nccl_watch_status(watch)[0] != 0:
                _comms.pop(key, None)
                del _watches[comm]  # aborted by NCCL already; its watch stays, unused


faults.add_probe(_probe)
faults.on_forget(_forget)
