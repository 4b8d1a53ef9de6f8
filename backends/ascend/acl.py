"""Device-side waits on a counter in device memory, through CANN's runtime (``libascendcl``).

``aclrtValueWrite(addr, value, 0, stream)`` stores a 64-bit value when the stream reaches it;
``aclrtValueWait(addr, value, flag, stream)`` holds the stream until the 64-bit word at
``addr`` satisfies ``flag`` (GEQ: ``(int64_t)(*addr - value) >= 0``). Both came with CANN 8.2
(Atlas A2/A3) and are looked up when first used, so older CANN fails with a message, not at
import. ``addr`` must be 8-byte aligned device memory; torch's NPU allocations are.

torch_npu launches most work through a host-side task queue. Reading ``Stream.npu_stream``
flushes that queue (torch_npu's ``NPUStream::stream()``), so a raw ACL call made right after
it is ordered after everything launched before it and before everything launched after it.
"""
from __future__ import annotations

import ctypes
import threading

ACL_LIBRARY = "libascendcl.so"
VALUE_WAIT_GEQ = 0x0  # ACL_STREAM_WAIT_VALUE_GEQ
VALUE_SYMBOLS = ("aclrtValueWrite", "aclrtValueWait")


class AclUnavailable(RuntimeError):
    """The CANN runtime or one of its functions is missing."""


class AclValueOps:
    """``aclrtValueWrite`` / ``aclrtValueWait`` on torch_npu streams."""

    def __init__(self, library: str = ACL_LIBRARY):
        try:
            lib = ctypes.CDLL(library)
        except OSError as e:
            raise AclUnavailable(f"cannot load CANN's runtime {library} ({e}); source "
                                 "<CANN>/set_env.sh, or use the ascend wait mode 'event'") from None
        missing = [name for name in VALUE_SYMBOLS if not hasattr(lib, name)]
        if missing:
            raise AclUnavailable(f"{library} has no {' or '.join(missing)}: the ascend wait mode "
                                 "'value' needs CANN >= 8.2 on Atlas A2/A3; use 'event'")
        self._write, self._wait = (getattr(lib, name) for name in VALUE_SYMBOLS)
        for fn in (self._write, self._wait):
            fn.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p)
            fn.restype = ctypes.c_int

    @staticmethod
    def _check(name: str, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"{name} failed with aclError {code}")

    def write(self, address: int, value: int, stream) -> None:
        self._check("aclrtValueWrite", self._write(address, value, 0, stream.npu_stream))

    def wait(self, address: int, value: int, stream) -> None:
        self._check("aclrtValueWait",
                    self._wait(address, value, VALUE_WAIT_GEQ, stream.npu_stream))


class MonotonicCounter:
    """One 64-bit counter in device memory that only grows: each call reserves the next
    ``n`` values, so no call resets it and a stale value can never release a later wait."""

    def __init__(self, tensor):
        self.tensor = tensor  # int64 [1], zero on the device before first use
        self.address = tensor.data_ptr()
        self.next = 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> int:
        """The value the counter holds before this call's ``n`` signals."""
        with self._lock:
            base, self.next = self.next, self.next + n
            return base


class ValueSignals:
    """Group signals as counter values: ``signal(g)`` writes base+g+1 on the compute stream
    after group g's stores, ``wait(g)`` holds the communication stream until the counter has
    reached it. ``ops`` provides ``write`` and ``wait`` (address, value, stream)."""

    def __init__(self, streams, ops, counter: MonotonicCounter, groups: int):
        self.streams, self.ops, self.counter = streams, ops, counter
        self.base = counter.reserve(groups)

    def signal(self, g: int) -> None:
        self.ops.write(self.counter.address, self.base + g + 1, self.streams.compute)

    def wait(self, g: int) -> None:
        self.ops.wait(self.counter.address, self.base + g + 1, self.streams.comm)
