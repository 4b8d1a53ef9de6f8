"""The ``ascend`` backend: Huawei Ascend NPUs through torch_npu (streams, events) and HCCL
(through torch.distributed), with ``aclrtValueWait`` as an optional device-side wait.

Importing this package is cheap and safe without torch_npu: nothing NPU-related is imported
until the backend is probed or run. See README.md here for the design of the AscendC
signaling GEMM and for what has been verified.
"""
from .backend import AscendBackend

__all__ = ["AscendBackend"]
