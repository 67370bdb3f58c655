"""What this process holds on its GPU, as nvidia-smi shows it: the number `model.memory_budget`
is a budget of (the CUDA context, cuBLAS and Triton's modules and workspaces, NCCL's buffers,
the caching allocator's reserved segments and its fragmentation, not only torch's tensors).

`process_gpu_bytes` asks NVML for this process's entry on the device (nvidia-ml-py, where it is
installed and the process is visible to the driver by its pid), else counts the whole device's
used memory (`cudaMemGetInfo`: total - free), which is this process's and any other's on the
same GPU: never less than what this process holds, so a budget checked against it is safe. What
is not here: what to do with the number (memory.py plans, runner.py sizes the KV cache).
"""

from __future__ import annotations

import os

import torch


def _nvml_process_bytes(device: torch.device) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = torch.cuda.get_device_properties(index).uuid
        handle = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            if str(uuid) in str(pynvml.nvmlDeviceGetUUID(h)):
                handle = h
        if handle is None:
            return None
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory:
                return int(p.usedGpuMemory)
    except pynvml.NVMLError:
        return None
    return None


def process_gpu_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes this process holds on `device`, how they were measured: 'nvml' or 'device')."""
    torch.cuda.synchronize(device)
    own = _nvml_process_bytes(device)
    if own is not None:
        return own, "nvml"
    free, total = torch.cuda.mem_get_info(device)
    return total - free, "device"


def free_device_bytes(device: torch.device) -> int:
    """What the GPU has free for anyone (cudaMemGetInfo)."""
    return torch.cuda.mem_get_info(device)[0]
