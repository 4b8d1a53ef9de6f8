"""Options of the ``ascend`` backend, validated by plain functions (no torch_npu needed).

``wait``: how the communication stream learns that a group's tiles are stored.

* ``"event"`` (default): an NPU event recorded on the compute stream after the group's
  sub-GEMMs; the communication stream waits on it (``aclrtStreamWaitEvent`` underneath).
* ``"value"``: a 64-bit counter in device memory. The compute stream raises it with
  ``aclrtValueWrite`` and the communication stream holds with ``aclrtValueWait`` (CANN >= 8.2)
  until it has reached the group's value: the device-side wait the signaling GEMM will use,
  with the GEMM's counter bump stood in for by the write. Off by default until it has been
  run on an NPU (see README.md, "What is verified").
"""
from __future__ import annotations

import os

ENV_WAIT = "FLASHOVERLAP_ASCEND_WAIT"
WAIT_MODES = ("event", "value")
DEFAULT_WAIT = "event"


def parse_wait_mode(value) -> str:
    """The wait mode named by ``value``; ValueError/TypeError saying what is accepted."""
    if not isinstance(value, str):
        raise TypeError(f"the ascend wait mode must be one of {WAIT_MODES}, "
                        f"got {type(value).__name__}")
    mode = value.strip().lower()
    if mode not in WAIT_MODES:
        raise ValueError(f"the ascend wait mode must be one of {WAIT_MODES}, got {value!r}")
    return mode


def wait_mode_from_env(environ=os.environ) -> str:
    """``FLASHOVERLAP_ASCEND_WAIT``, else the default."""
    value = environ.get(ENV_WAIT)
    if value is None or value == "":
        return DEFAULT_WAIT
    try:
        return parse_wait_mode(value)
    except ValueError:
        raise ValueError(f"{ENV_WAIT} must be one of {WAIT_MODES}, got {value!r}") from None
