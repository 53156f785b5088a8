"""How the process uses memory on a long scan: huge pages and glibc's mmap threshold. Both
are settings of the process made before the first large allocation; nothing here imports
torch, which reads the first of them when it starts allocating."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

THP_SWITCH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
"""Where Linux says whether it offers transparent huge pages."""


def use_huge_pages(switch: Path = THP_SWITCH) -> bool:
    """Ask torch to back its CPU tensors of 2 MiB and more with transparent huge pages
    (``THP_MEM_ALLOC_ENABLE=1``) where Linux offers them, unless the environment already
    sets it; True when it is on.

    A scan reads each tensor into fresh memory and makes per-row temporaries: in 4 KiB pages
    the page faults are a large share of a clip-rate scan's time (measured in
    ``docs/performance-history.md``). Torch reads the setting at its first allocation in the
    process, so this takes effect only when called before that: the drift command calls it first; a
    notebook calls it before making any tensor, or sets the variable.
    """
    key = "THP_MEM_ALLOC_ENABLE"
    if key not in os.environ:
        try:
            offered = "[never]" not in switch.read_text()
        except OSError:  # not Linux, or a kernel without huge pages
            offered = False
        if offered:
            os.environ[key] = "1"
    return os.environ.get(key) == "1"


MMAP_THRESHOLD = 4 << 20
"""Allocations at least this big are mapped anew and returned on free (see bound_memory)."""


def bound_memory() -> None:
    """Keep a long scan's memory near one slice's worth. glibc raises its mmap threshold to
    the size of every large block freed (up to 32 MiB), so slice-sized buffers of varying
    sizes then come from the heap, which fragments and grows a scan's resident memory well
    past its slices; a fixed threshold maps them anew each time (the figures are in
    ``docs/performance-history.md``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc: its allocator, its behaviour
        pass


_M_MMAP_THRESHOLD = -3


def available_memory() -> int:
    """Bytes this process may still allocate: Linux's ``MemAvailable``, capped by the
    address-space limit (``RLIMIT_AS``) where one is set; physical memory where there is no
    ``/proc/meminfo``. What a size read from a file is checked against before it is built."""
    import resource

    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            free = next(int(line.split()[1]) * 1024 for line in fh
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return free
    try:  # the limit counts the address space already mapped
        with open("/proc/self/status", encoding="ascii") as fh:
            mapped = next(int(line.split()[1]) * 1024 for line in fh
                          if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mapped = 0
    return max(0, min(free, soft - mapped))
