"""What every example does first: join the process group when a launcher started this process.

``torchrun --nproc_per_node W example.py`` sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` (and
where rank 0 listens): each rank then takes its own accelerator, when there is one, and joins
the default group with that device's collective library (gloo on the CPU, nccl on CUDA, hccl on
Ascend NPUs). ``python example.py`` runs alone, at world size 1, without torch.distributed.
"""
from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist


def start() -> int:
    """Join the default process group when started by a launcher; return the world size."""
    if "WORLD_SIZE" not in os.environ:
        return 1
    if not dist.is_initialized():
        accelerator = (torch.accelerator.current_accelerator()
                       if torch.accelerator.is_available() else None)
        device = torch.device("cpu")
        if accelerator is not None:
            torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device(accelerator.type, torch.accelerator.current_device_index())
        dist.init_process_group(dist.get_default_backend_for_device(device),
                                device_id=device if accelerator is not None else None)
        atexit.register(leave)
    return dist.get_world_size()


def leave() -> None:
    """At exit: wait for every rank, then leave the group. A rank that closes its connections
    while another still uses them can make that one abort (gloo's "connection closed by
    peer"); if a rank died instead, torchrun has already stopped the others."""
    dist.barrier()
    dist.destroy_process_group()
