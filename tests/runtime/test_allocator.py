"""dpocache.runtime.allocator: under "retain", glibc keeps freed tensor memory for reuse instead of
returning it to the kernel and faulting it back in (observed in resident memory, in a fresh
process per mode)."""

import os
import subprocess
import sys
import textwrap

import pytest

from dpocache.runtime.allocator import ENV, configure_cpu_allocator

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings (Linux only)")

# Resident MiB gained by allocating (and writing) a block and then lost by freeing it, for a
# 24 MiB block and a 200 MiB block.
_PROBE = textwrap.dedent("""
    import torch
    from dpocache.runtime.allocator import configure_cpu_allocator
    configured = configure_cpu_allocator()
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
    for mib in (24, 200):
        before = rss()
        block = torch.ones(mib << 18)  # fp32: 2^18 elements per MiB
        held = rss()
        del block
        print(configured, mib, held - before, held - rss())
""")


def _probe(mode: str) -> list[tuple[int, int, int]]:
    """[(MiB, resident MiB gained on allocation, resident MiB returned on free)] in a fresh process."""
    env = {**os.environ, ENV: mode}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True).stdout
    lines = [line.split() for line in out.splitlines()]
    assert {line[0] for line in lines} == {"True" if mode == "retain" else "False"}
    return [(int(mib), int(gained), int(returned)) for _, mib, gained, returned in lines]


@glibc
def test_retain_keeps_freed_blocks_for_reuse():
    (small, big) = _probe("retain")
    assert small[1] >= 20 and small[2] <= 2  # the freed 24 MiB block stays in the process
    assert big[1] >= 190 and big[2] >= 190  # above the 32 MiB threshold, blocks still go back at once


@glibc
def test_default_returns_a_first_freed_block_to_the_kernel():
    # glibc's own behaviour, unchanged: what "retain" exists to avoid.
    (small, big) = _probe("default")
    assert small[1] >= 20 and small[2] >= 20
    assert big[2] >= 190


def test_unknown_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV, "jemalloc")
    with pytest.raises(ValueError, match=f"{ENV} must be one of retain, default; got 'jemalloc'"):
        configure_cpu_allocator()


def test_default_mode_changes_nothing():
    assert configure_cpu_allocator("default") is False


def test_cuda_allocator_gets_expandable_segments_unless_the_user_chose(monkeypatch):
    from dpocache.runtime.allocator import CUDA_ALLOC_ENV, configure_cuda_allocator

    monkeypatch.delenv(CUDA_ALLOC_ENV, raising=False)
    assert configure_cuda_allocator() is True  # CUDA is never initialised in the CPU tests
    assert os.environ[CUDA_ALLOC_ENV] == "expandable_segments:True"
    monkeypatch.setenv(CUDA_ALLOC_ENV, "max_split_size_mb:128")
    assert configure_cuda_allocator() is False
    assert os.environ[CUDA_ALLOC_ENV] == "max_split_size_mb:128"


def test_optimizer_on_cpu_keeps_the_default_implementation():
    import torch

    from dpocache.config import Config
    from dpocache.models.policy import build_optimizer

    assert build_optimizer(Config(), torch.nn.Linear(4, 4)).defaults["fused"] is None
