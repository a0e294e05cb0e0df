"""The fp32 CPU output head alone, in tiles of several shapes, side by side.

    python bench/probes/head_tiles.py [ROWSxWORDS ...]     # default: 1024x1024 1024x2048 2048x1024 512x2048 1024x512

``CompletionLogProbs``'s fp32 CPU inference head (``dpocache.scoring.logprobs.CPU_TILE_ROWS`` x
``CPU_TILE_VOCAB``: a log-sum-exp carried across vocabulary tiles) on the 58m benchmark's head
shape (4,096 scored rows, hidden 512, vocab 32000), the shapes interleaved within each of 6
rounds (the first not timed); prints the median GFLOP/s of each shape and checks that all give
the same log-probs. Used to pick the tile shape on a new CPU.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # dpocache in a checkout not installed

import dpocache.scoring.logprobs as logprobs  # noqa: E402
from dpocache.runtime.allocator import configure_cpu_allocator  # noqa: E402


class _Config:
    vocab_size = 32000

    def get_text_config(self):
        return self


def main(argv: list[str]) -> None:
    configure_cpu_allocator()
    torch.manual_seed(0)
    rows, hidden, vocab = 4096, 512, _Config.vocab_size
    shapes = [tuple(int(x) for x in s.split("x")) for s in argv] or [
        (1024, 1024), (1024, 2048), (2048, 1024), (512, 2048), (1024, 512)]
    head = nn.Linear(hidden, vocab, bias=False)
    model = nn.Module()
    model.config = _Config()
    model.get_output_embeddings = lambda: head
    scorer = logprobs.CompletionLogProbs(model, probe=False)
    h, labels = torch.randn(rows, hidden), torch.randint(0, vocab, (rows,))
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    first = None
    with torch.no_grad():
        for round_ in range(6):
            for shape in shapes:
                logprobs.CPU_TILE_ROWS, logprobs.CPU_TILE_VOCAB = shape
                start = time.perf_counter()
                out = scorer.head_logps(h, labels)
                if round_:
                    times[shape].append(time.perf_counter() - start)
                first = out if first is None else first
                torch.testing.assert_close(out, first, rtol=0, atol=1e-4)
    for shape, ts in times.items():
        med = statistics.median(ts)
        print(f"{shape[0]} x {shape[1]}: {2 * rows * hidden * vocab / med / 1e9:.0f} GFLOP/s ({med * 1e3:.0f} ms)")


if __name__ == "__main__":
    main(sys.argv[1:])
