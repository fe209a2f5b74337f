"""Where and in what weights go: the dtypes the model runs in (given as a torch.dtype or its name), the
device (checked against what torch sees), and the host memory a CPU allocation needs, checked before
it is made (the kernel's out-of-memory killer ends a process without a message); the memory a cache or
a runner's buffers ask for, checked on any device before they are allocated."""

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
    return _meminfo("MemAvailable:", "SC_AVPHYS_PAGES")


def total_memory() -> int | None:
    """Bytes of host memory in all: /proc/meminfo's MemTotal, else the physical pages; None when not known."""
    return _meminfo("MemTotal:", "SC_PHYS_PAGES")


def _meminfo(field: str, pages: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(bytes a new allocation on `device` may take, bytes in all): on the CPU the host's available and total
    memory; on CUDA the device's free memory plus what torch's caching allocator holds unused, and its total."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total
    return available_memory(), total_memory()


class NotEnoughMemory(ValueError):
    """check_memory's refusal: a ValueError (bad sizes), of its own class so that a tool can name the flags
    that asked for the sizes."""


def check_memory(asks: list[tuple[str, int]], device, what: str) -> None:
    """Before allocating `what`: ValueError when its bytes exceed what `device` may still take, naming each of
    `asks` (what it sizes with the argument and value that size it, e.g. "GDN state checkpoints
    (prefix_checkpoints=1000)", and its bytes), largest first, and the device's free and total memory: an
    absurd size is an error that says which argument asked for it, not the allocator's (or, on the CPU, the
    out-of-memory killer)."""
    device = torch.device(device)
    need = sum(n for _, n in asks)
    free, total = device_memory(device)
    if free is None or need <= free:
        return
    has = f"{_size(free)} free" + (f" of {_size(total)}" if total is not None else "")
    parts = ", ".join(f"{name} {_size(n)}" for name, n in sorted(asks, key=lambda ask: -ask[1]))
    raise NotEnoughMemory(f"{what} need {_size(need)} of memory and {device} has {has}: {parts}")


def check_host_memory(nbytes: int, device: torch.device, what: str) -> None:
    """On the CPU, ValueError when `nbytes` (for `what`) exceed the memory available; elsewhere nothing."""
    if device.type != "cpu":
        return
    available = available_memory()
    if available is not None and nbytes > available:
        raise ValueError(f"{what} need {_size(nbytes)} of memory and this machine has {_size(available)} "
                         "available: use a smaller dtype (bfloat16), a smaller model, tensor parallelism or a GPU")


def _size(nbytes: int) -> str:
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if nbytes >= 2 ** shift:
            return f"{nbytes / 2 ** shift:.1f} {unit}"
    return f"{nbytes / 2 ** 10:.1f} KiB"
