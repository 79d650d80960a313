"""What an engine exception says about the device it ran on.

- out of memory: the batch was too large for what is free; retry smaller.
- device lost: a CUDA error other than out-of-memory (an illegal access, a device-side
  assert, ECC, a fallen-off-the-bus GPU) leaves the CUDA context unusable for the rest of
  the process: the worker must exit so its supervisor restarts it.
- anything else: transient until it repeats (worker/tasks.py counts attempts).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_DEVICE_MARKERS = (
    "cuda error", "cublas_status", "cudnn_status", "cudnn error", "nccl error",
    "device-side assert", "illegal memory access", "unspecified launch failure",
    "ecc error", "hip error",
)


class DeviceLost(RuntimeError):
    """The device cannot be used by this process any more."""


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def is_device_lost(exc: BaseException) -> bool:
    if is_out_of_memory(exc):
        return False
    if isinstance(exc, getattr(torch, "AcceleratorError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _DEVICE_MARKERS)


def free_memory(device: torch.device) -> None:
    """Hand cached blocks back after an engine exception (a no-op off CUDA). A lost device
    refuses this too: that error is logged, and the caller's own (is_device_lost) decides."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.empty_cache()
    except RuntimeError as exc:  # torch.AcceleratorError is one
        log.warning("could not free the device's cached memory: %s", exc)
