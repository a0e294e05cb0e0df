"""Process-wide settings of glibc's ``malloc`` for dpocache's CPU work.

PyTorch's CPU tensors come from ``malloc``. glibc serves a block above its mmap threshold with a
fresh ``mmap`` and returns it to the kernel on ``free``; the threshold adapts upwards (to at most
32 MiB) only as such blocks are freed, and the heap's free top is trimmed above twice that. A
reference pass allocates and frees activation-sized blocks (an MLP activation of 4,000 tokens
is 22 MB) many times per batch, and each block the kernel took back is page-faulted and zeroed
again on its next use; how often depends on the order of earlier allocations.

``configure_cpu_allocator("retain")`` pins the mmap threshold at 32 MiB from the start and
raises the trim threshold to 1 GiB, so freed blocks up to 32 MiB stay in the process and are
reused. On the ``58m`` benchmark's reference pass that cut the minor page faults to a fraction
and removed the slow outliers, at the same median speed and peak RSS; training steps measured
no different (docs/benchmarks/levers-cpu-2core-20261123.md).

It changes the whole process, so the command-line entry points and ``dpocache.training.loop.train``
call it, not library functions; ``DPOCACHE_CPU_ALLOCATOR=default`` leaves ``malloc`` as it was.
Outside glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

ENV = "DPOCACHE_CPU_ALLOCATOR"
MODES = ("retain", "default")
# Blocks up to 32 MiB (glibc's own ceiling for its adaptive threshold, pinned from the start)
# come from the heap; larger ones are still mmap-ed, so a one-off giant block is returned at
# once. A threshold of 1 GiB measured the same speed but a higher peak RSS (fragmentation;
# docs/benchmarks/levers-cpu-2core-20261123.md, "Not adopted").
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the heap's top is kept up to this much instead of trimmed and faulted back.
TRIM_THRESHOLD_BYTES = 1 << 30

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_configured: str | None = None


def configure_cpu_allocator(mode: str | None = None) -> bool:
    """Apply ``mode`` (default: ``$DPOCACHE_CPU_ALLOCATOR``, else ``retain``); True when glibc
    took the settings. Idempotent: a second call with the same mode does nothing."""
    global _configured
    mode = mode or os.environ.get(ENV) or "retain"
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}; got '{mode}'")
    if mode == "default" or not sys.platform.startswith("linux"):
        return False
    if _configured == mode:
        return True
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if ok:
        _configured = mode
    else:
        log.debug("mallopt refused the allocator settings; malloc keeps its defaults")
    return ok


def trim_heap() -> bool:
    """Hand the free memory of glibc's heaps back to the system (``malloc_trim(0)``); True
    when it ran. Freed blocks below the mmap threshold otherwise stay in the process (the
    trim threshold above keeps up to 1 GiB at the heap's top, and per-thread arenas are rarely
    trimmed at all): after loading a model shard by shard, or after a sharded layer's gathered
    parameters are freed, that is memory the process will not use again soon. Outside glibc:
    nothing."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True


_malloc_trim = None  # glibc's malloc_trim once looked up; False outside glibc


CUDA_ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def configure_cuda_allocator() -> bool:
    """Ask PyTorch's CUDA caching allocator for expandable segments, unless the user set
    ``$PYTORCH_CUDA_ALLOC_CONF`` or CUDA is already initialised (the setting is read once).

    The reference pass and training allocate activations of a different size for every batch
    (token-budget batches of varying width); with fixed segments, freed blocks of one size do not
    serve the next, and a 1.1B bf16 training run at batch 8 on an 80 GB H100 stopped out of memory
    with a large part of its memory reserved but unallocated (docs/benchmarks/vs-trl-h100-20261123.md).
    Expandable segments grow one mapping instead, as torchtitan and torchtune configure it. True
    when the setting was made."""
    if os.environ.get(CUDA_ALLOC_ENV) is not None:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ[CUDA_ALLOC_ENV] = "expandable_segments:True"
    return True
