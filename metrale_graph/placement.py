"""Where and in what weights go: the dtypes the model runs in (given as a torch.dtype or its name), the
device (checked against what torch sees), and the host memory a CPU allocation needs, checked before
it is made (the kernel's out-of-memory killer ends a process without a message)."""

from __future__ import annotations

import os

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def as_dtype(dtype) -> torch.dtype:
    """One of DTYPES, given as a torch.dtype or by torch's name for it ('bfloat16', 'torch.float16',
    'float', 'half'); anything else is a ValueError naming the choices."""
    if isinstance(dtype, str):
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(named, torch.dtype) and named in DTYPES:
            return named
        names = ", ".join(repr(str(d).removeprefix("torch.")) for d in DTYPES)
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {names} (or the torch.dtype itself)")
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(map(str, DTYPES))}")
    return dtype


def as_device(device) -> torch.device:
    """A torch.device from a device or its name; a CUDA device torch cannot use ('cuda' without a GPU,
    'cuda:3' on a machine of two) is a ValueError naming it and what torch sees."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(dev)!r}: a model runs on 'cpu' or 'cuda' (its weights are read and its "
                         f"kernels run there)")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device {str(dev)!r} is not available: torch sees no CUDA GPU (torch "
                             f"{torch.__version__}, {build}); use device='cpu'")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(dev)!r} is not available: torch sees {count} CUDA GPU(s), "
                             f"cuda:0 to cuda:{count - 1}")
    return dev


def available_memory() -> int | None:
    """Bytes of host memory available to a new allocation without swapping: /proc/meminfo's MemAvailable,
    else the free pages (os.sysconf); None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_memory(nbytes: int, device: torch.device, what: str) -> None:
    """On the CPU, ValueError when `nbytes` (for `what`) exceed the memory available; elsewhere nothing."""
    if device.type != "cpu":
        return
    available = available_memory()
    if available is not None and nbytes > available:
        raise ValueError(f"{what} need {_size(nbytes)} of memory and this machine has {_size(available)} "
                         "available: use a smaller dtype (bfloat16), a smaller model, tensor parallelism or a GPU")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.1f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.1f} MiB"
