"""worker/device.py: what an engine exception says about the device.

A CUDA device cannot be lost on this machine: the lost device's errors are raised here by a
stand-in for torch.cuda.empty_cache (the one mock, where a GPU cannot run)."""

from __future__ import annotations

import pytest
import torch

from specq.worker import device


def test_a_lost_device_is_told_from_out_of_memory():
    lost = torch.AcceleratorError("CUDA error: device-side assert triggered")
    assert device.is_device_lost(lost) and not device.is_out_of_memory(lost)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert device.is_out_of_memory(oom) and not device.is_device_lost(oom)
    assert not device.is_device_lost(IndexError("index out of range in self"))


def test_freeing_memory_on_a_lost_device_does_not_hide_the_fault(monkeypatch, caplog):
    """After a device-side assert, emptying the cache fails too; the caller must still get to
    classify the original fault (worker/attempts.py raises DeviceLost), not this one."""
    def refuse() -> None:
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "empty_cache", refuse)
    device.free_memory(torch.device("cuda"))  # logged, not raised
    assert "could not free the device's cached memory" in caplog.text
    device.free_memory(torch.device("cpu"))  # nothing to free off CUDA

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (_ for _ in ()).throw(
        ValueError("not a device error")))
    with pytest.raises(ValueError):  # only the device's own errors are swallowed
        device.free_memory(torch.device("cuda"))
