"""What this machine has for the ``ascend`` backend, found without creating a device context.

In order: is ``torch_npu`` installed (``importlib.util.find_spec``, nothing imported), does it
import (it needs CANN's libraries: ``source <CANN>/set_env.sh``), and how many NPUs it sees.
Importing torch_npu registers ``torch.npu`` but initialises no device; recent torch_npu counts
devices through the driver (``drvGetDevNum``) before any initialisation, older ones through
``aclrtGetDeviceCount``, neither of which opens a device context.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache

INSTALL_HINT = "pip install flashoverlap[ascend]"
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"


def _import_torch_npu():
    """The torch_npu module, or the reason it cannot be had."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, f"torch_npu is not installed ({INSTALL_HINT})"
    try:
        return importlib.import_module("torch_npu"), None
    except Exception as e:  # noqa: BLE001 - any import failure is a reason, not a crash
        return None, (f"torch_npu is installed but does not import ({type(e).__name__}: {e}); "
                      "is CANN's set_env.sh sourced and torch_npu built for this torch?")


@lru_cache(maxsize=1)
def probe_reason() -> str | None:
    """None when torch_npu imports and sees at least one NPU, else why not (cached: it
    imports torch_npu once)."""
    torch_npu, reason = _import_torch_npu()
    if reason is not None:
        return reason
    count = torch_npu.npu.device_count()
    if count < 1:
        visible = os.environ.get(VISIBLE_DEVICES)
        where = f" with {VISIBLE_DEVICES}={visible!r}" if visible is not None else ""
        return f"torch_npu sees no NPU{where} (torch_npu.npu.device_count() == 0)"
    return None


def device_count() -> int:
    if probe_reason() is not None:
        return 0
    return importlib.import_module("torch_npu").npu.device_count()


def versions() -> dict[str, str]:
    """torch_npu, CANN and HCCL versions when torch_npu imports (empty otherwise)."""
    torch_npu, reason = _import_torch_npu()
    if reason is not None:
        return {}
    out = {"torch_npu": str(getattr(torch_npu, "__version__", "unknown"))}
    try:  # torch_npu.utils.get_cann_version: torch_npu >= 2.5, CANN >= 8.1.RC1 ("" before)
        get = importlib.import_module("torch_npu.utils").get_cann_version
    except (ImportError, AttributeError):
        get = None
    for key, module in (("cann", "CANN"), ("hccl", "HCCL")):
        found = get(module=module) if get is not None else ""
        out[key] = found or "unknown (needs torch_npu.utils.get_cann_version and CANN >= 8.1)"
    return out
