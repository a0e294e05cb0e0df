"""How fast a streamed layer's copy runs on this machine, and whether it keeps that speed while
the GPU computes: the ceiling ``--stream-base`` and ``--stream-reference`` copy against
(``dpocache.models.streaming``).

    python bench/probes/h2d_copy_probe.py [--gib 0.41] [--copies 16] [--matmul 8192]

Copies a host buffer of an 8B Llama layer's size (0.41 GiB) to the device, one copy after
another on a side stream, as the streamed layers are copied, each timed by events on that
stream: from page-locked memory alone, from pageable memory alone, and from page-locked memory
while the default stream runs bf16 matrix products (``--matmul`` square) the whole time; and
the matrix products' rate alone and beside the copies. Also where the GPU sits: its NUMA node
and the nodes of the CPUs this process may run on (a page-locked buffer on the far socket
copies slower). Prints one JSON line. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def numa_nodes() -> dict:
    """The GPU's NUMA node (-1: the kernel does not say) and the nodes of this process's CPUs."""
    import torch

    props = torch.cuda.get_device_properties(0)
    bus = getattr(props, "pci_bus_id", None)
    gpu_node = None
    if bus is not None:
        address = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        path = Path("/sys/bus/pci/devices") / address / "numa_node"
        gpu_node = int(path.read_text()) if path.is_file() else None
    allowed = os.sched_getaffinity(0)
    cpu_nodes = set()
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        cpus = set()
        for part in (node / "cpulist").read_text().strip().split(","):
            if part:
                first, _, last = part.partition("-")
                cpus |= set(range(int(first), int(last or first) + 1))
        if cpus & allowed:
            cpu_nodes.add(int(node.name[4:]))
    return {"gpu_numa_node": gpu_node, "cpu_numa_nodes": sorted(cpu_nodes), "cpus": len(allowed)}


def copy_rates(host, device, copies: int, stream) -> list[float]:
    """GB/s of each of ``copies`` back-to-back copies of ``host`` into ``device`` on ``stream``."""
    import torch

    events = []
    with torch.cuda.stream(stream):
        for _ in range(copies):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            device.copy_(host, non_blocking=True)
            end.record(stream)
            events.append((start, end))
    torch.cuda.synchronize()
    return [host.numel() / (start.elapsed_time(end) / 1000) / 1e9 for start, end in events]


def matmul_rate(a, b, seconds: float) -> tuple[float, int]:
    """TFLOP/s of back-to-back ``a @ b`` on the default stream for about ``seconds``; the count run."""
    import torch

    n = a.shape[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    a @ b
    end.record()
    torch.cuda.synchronize()
    count = max(1, int(seconds / (start.elapsed_time(end) / 1000)))
    start.record()
    for _ in range(count):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * count / (start.elapsed_time(end) / 1000) / 1e12, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.41, help="the buffer's size (an 8B Llama layer: 0.41)")
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--matmul", type=int, default=8192, help="the square bf16 matrices' size")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("h2d_copy_probe: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    size = int(args.gib * 2**30)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.empty(size, dtype=torch.uint8).fill_(1)
    slot = torch.empty(size, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    copy_rates(pinned, slot, 2, side)  # warm-up
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gib": args.gib,
              "copies": args.copies, **numa_nodes()}
    result["pinned_gb_s"] = statistics.median(copy_rates(pinned, slot, args.copies, side))
    result["pageable_gb_s"] = statistics.median(copy_rates(pageable, slot, max(2, args.copies // 4), side))
    a = torch.randn(args.matmul, args.matmul, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    alone, count = matmul_rate(a, b, 1.0)
    result["matmul_tflop_s"] = alone
    # beside each other: the products queued on the default stream first, the copies behind them
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(count):
        a @ b
    end.record()
    beside = copy_rates(pinned, slot, args.copies, side)
    torch.cuda.synchronize()
    window_s = start.elapsed_time(end) / 1000
    result["pinned_gb_s_beside_matmul"] = statistics.median(beside)
    result["matmul_tflop_s_beside_copies"] = 2 * args.matmul**3 * count / window_s / 1e12
    # the copies ran beside the products only if they ended within the products' window
    result["copies_within_matmul"] = sum(size / (rate * 1e9) for rate in beside) < window_s
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
