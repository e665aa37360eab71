"""Host memory a CPU engine's steps reuse, instead of pages the kernel hands out anew.

A prompt step of a few thousand tokens makes tensors of tens of MB in every layer (the
MLP's gate/up output for 3,000 fp32 rows is 37 MB) and frees them a moment later. glibc's
malloc serves a request above its mmap threshold (128 KB at first, raised to at most
32 MB as such blocks are freed) with freshly mapped pages and unmaps them on free, and it
gives the top of its heap back to the kernel once more than twice that threshold lies free
there. So each step writes into brand-new pages, and the kernel faults in and zeroes every
4 KB of them on first touch. On a 2-core AMD EPYC, the first two doc-QA prompts (3,325
new fp32 tokens in one step) took about 505,000 page faults and 2.9 s; with freed memory
kept for reuse, 67,000 and 2.4 s.

`keep_freed_memory()` sets glibc's malloc (through `mallopt`) to serve requests of up to
1 GiB from its heap and never to trim it, so a step's buffers land in pages an earlier
step already faulted in. vLLM's CPU backend reaches the same end by preloading tcmalloc
where its wheel bundles it (vllm/platforms/cpu.py in vLLM 0.32, "to reduce memory
allocation overhead"). The cost: the process keeps its peak heap instead of returning it.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
LARGEST_FROM_HEAP = 1 << 30  # bytes: requests up to this size come from the heap
NEVER_TRIM = 2**31 - 1  # bytes free at the heap's top before it is given back (an int)


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse (see the module docstring), once per
    process; returns whether it took the settings (False where the C library is not glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):  # no C library to load by that name (Windows)
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc (musl, macOS)
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, LARGEST_FROM_HEAP):  # a glibc that caps it at 32 MB
        mallopt(M_MMAP_MAX, 0)  # then no mmap'd blocks at all: the heap serves every size
    return bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
