"""What the native calls of the ``cuda`` backend share, whatever their kind (the overlapped call
:mod:`.overlap_call`, :mod:`.all_to_all_call`, :mod:`.gather_call`):

* per compute stream, a :class:`CallState` of its own (its communication stream, its native
  call, the buffers both streams use), made on the stream's first call outside graph pools, so
  that two calls in flight on two streams share none of it;
* the first call of a (kernel library, group, op, dtype) runs with host syncs, so that every
  kernel it uses is loaded before any call overlaps (:class:`WarmUps`; docs/design.md, "The
  call path");
* a native error raised with the GEMM library's own detail.
"""
from __future__ import annotations

import torch

from . import nccl
from .device_state import _current_stream_getter, outside_graph_pools
from .runtime import ABI_VERSION, KernelError


class WarmUps:
    """The (kernel library, group, op, dtype) keys whose first call ran with host syncs: one
    set per backend, shared by its calls of every kind."""

    def __init__(self):
        self._done: set = set()

    def first(self, key) -> bool:
        """Whether a call of this key must run with host syncs first (then marked as done); in
        CUDA-graph capture that is an error that says what to do."""
        if key in self._done:
            return False
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "the first call of this shape, op and process group cannot be captured in a CUDA "
                "graph: it loads its kernels with host synchronisation. Run it once outside the "
                "capture (a warm-up call, as torch.cuda.graphs recommends), then capture")
        self._done.add(key)
        return True


def new_description(kind):
    """An empty native call description of this ``kind`` (a description class of the runtime,
    e.g. ``CallDescription``), stamped with the ABI version the runtime checks."""
    desc = kind()
    desc.abi_version = ABI_VERSION
    return desc


class CallState:
    """What the calls of one key on one compute stream use, and no other call: a communication
    stream (high priority; none when the call has no collective), the native call (``handle``,
    destroyed with the state) and the device buffers both streams use."""

    def __init__(self, device: torch.device, runtime=None, comm: bool = True):
        self.runtime, self.handle = runtime, None
        self.comm = None
        if comm:
            _, high = torch.cuda.Stream.priority_range()
            self.comm = torch.cuda.Stream(device=device, priority=high)

    def keep_for_comm(self, tensors) -> None:
        """Free ``tensors`` only once the communication stream is done with them."""
        if self.comm is not None:
            for t in tensors:
                if t is not None:
                    t.record_stream(self.comm)

    def destroy(self) -> None:
        """Destroy the native call ``handle`` (each kind's own runtime function)."""
        raise NotImplementedError

    def __del__(self):
        if getattr(self, "handle", None) and getattr(self, "runtime", None) is not None:
            self.destroy()


class NativeCall:
    """The native calls of one key, whatever their kind: the state of each compute stream
    (:meth:`new_state`, made on the stream's first call), the first call's warm-up
    (``warm_key``) and the error raise (``runtime``, ``gemm``: set by the kind)."""

    warm_key = None
    runtime = None
    gemm = None

    def __init__(self, device: torch.device, warm_ups: WarmUps):
        self.device, self.index = device, device.index
        self.warm_ups = warm_ups
        self.current_stream = _current_stream_getter()
        self._states: dict[int, CallState] = {}

    def new_state(self) -> CallState:
        """A new state for a compute stream (run outside graph pools, that stream current)."""
        raise NotImplementedError

    def state_made(self, state: CallState) -> None:
        """What a new state needs after :meth:`new_state`, in the caller's thread."""

    def state(self, stream: int | None = None) -> CallState:
        """This compute stream's state, made on its first call (outside graph pools)."""
        if stream is None:
            stream = self.current_stream(self.index)
        state = self._states.get(stream)
        if state is None:
            state = outside_graph_pools(self.new_state, torch.cuda.current_stream(self.device))
            self.state_made(state)
            self._states[stream] = state
        return state

    def needs_warm_up(self) -> bool:
        """Whether this call is the first of its ``warm_key`` (then it runs with host syncs)."""
        return self.warm_ups.first(self.warm_key)

    def raise_error(self, err: int, what: str = "the native call") -> None:
        """The runtime's error for ``err`` from ``what``, with the GEMM library's own detail; the
        group's ``fo.CommunicationError`` when the watchdog failed this call's communicator."""
        try:
            self.runtime.check(err, what, self.gemm)
        except KernelError as e:
            failure = nccl.failure(getattr(self, "comm", None))
            if failure is None:
                raise
            raise failure from e
