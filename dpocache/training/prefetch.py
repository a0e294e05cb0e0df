"""Training's micro-batches: which pairs each holds (``step_indices``), and each laid out on the
host (``prepare``) ahead, on a background thread, while the device runs the current one.

A micro-batch's host work (its pairs read from the token store, the layout's rows, masks and
position ids, its cached reference values selected) is pure: it depends only on the pair
indices. ``Prefetcher`` does it for the next micro-batches on one background thread, into
page-locked memory on CUDA, so the training step's copy to the GPU is ``non_blocking`` behind
the work already queued. The host's one wait per optimizer step (the divergence check,
``loop.train_step``) is then time the thread fills with the next step's layout, instead of the
GPU idling while the main thread collates.

On a CPU the device *is* the host: the thread would take a core from the forward. ``auto``
prefetches on CUDA only (``train.prefetch``). Prefetched or not, a step computes exactly the
same values (``tests/training/test_prefetch.py``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dpocache.config import PREFETCHES
from dpocache.data.order import epoch_order
from dpocache.data.pairs import TokenizedPair
from dpocache.data.values import PairValues
from dpocache.scoring.layouts import LaidOut, lay_out
from dpocache.scoring.logprobs import scorer_core
from dpocache.training.state import Run, global_batch

DEPTH = 2  # micro-batches laid out ahead: the next step's first while this step's last runs, and one more


@dataclass
class MicroBatch:
    """One micro-batch as the objective takes it: the pairs at ``idx``, laid out, and their
    cached reference values (None: a loss without a reference), all on the host."""

    idx: list[int]
    pairs: list[TokenizedPair]
    laid: LaidOut
    ref: PairValues | None


def prepare(run: Run, data, ref: PairValues | None, idx: list[int], pin: bool = False) -> MicroBatch:
    """The micro-batch of ``data``'s pairs at ``idx`` for ``run``'s policy and layout; ``ref``:
    the reference values of the whole of ``data`` (None: none). ``pin``: in page-locked memory."""
    pairs = [data.pairs[i] for i in idx]
    config = scorer_core(run.scorer).config
    laid = lay_out(run.layout.used, pairs, run.tokenizer.pad_token_id or 0, config)
    values = ref.select(idx) if ref is not None else None
    if pin:
        laid = laid.pin_memory()
        values = values.map(torch.Tensor.pin_memory) if values is not None else None
    return MicroBatch(list(idx), pairs, laid, values)


def step_indices(run: Run, step: int, micro: int) -> list[int]:
    """Pair indices of this rank's micro-batch ``micro`` of optimizer step ``step``.

    The global batch of a step is a slice of the epoch's seeded permutation (filled up to whole
    batches, ``dpocache.data.order.epoch_order``); micro-batch ``a`` of rank ``r`` is its
    ``(a * world + r)``-th block of ``batch_size``. So a run on W ranks with batch b sees
    exactly the pairs of a 1-rank run with batch W*b.
    """
    cfg, env = run.cfg.train, run.env
    batch = global_batch(run)
    epoch, within = divmod(step, run.steps_per_epoch)
    order = epoch_order(len(run.train_data), cfg.seed, epoch, batch)
    start = within * batch + (micro * env.world_size + env.rank) * cfg.batch_size
    return order[start:start + cfg.batch_size]


def prefetching(setting: str, device: torch.device) -> bool:
    """Whether ``train.prefetch`` (auto | on | off) lays micro-batches out ahead on ``device``."""
    if setting not in PREFETCHES:
        raise ValueError(f"train.prefetch must be one of {', '.join(PREFETCHES)}; got '{setting}'")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


class Prefetcher:
    """Training's micro-batches, in the order the loop asks for them: ``get(step, micro)``
    returns that micro-batch (the pairs ``step_indices`` gives) and starts laying out the
    ``depth`` after it. ``background=False``: each is laid out when asked for, on the
    caller's thread (the same values; the switch ``train.prefetch`` turns)."""

    def __init__(self, run, background: bool, depth: int = DEPTH):
        self.run, self.depth = run, depth
        self.pin = background and run.env.device.type == "cuda"
        self.pending: dict[tuple[int, int], Future] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dpocache-prefetch") if background else None

    def get(self, step: int, micro: int) -> MicroBatch:
        future = self.pending.pop((step, micro), None)
        # Anything queued for other steps is stale (a resumed or restarted loop): dropped.
        for stale in [key for key in self.pending if key <= (step, micro)]:
            self.pending.pop(stale).cancel()
        batch = future.result() if future is not None else self._prepare(step, micro)
        self._ahead(step, micro)
        return batch

    def close(self) -> None:
        """Stop the thread, dropping what it had not started (a stopped run exits at once)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.pending.clear()

    def _prepare(self, step: int, micro: int) -> MicroBatch:
        run = self.run
        return prepare(run, run.train_data, run.ref_train, step_indices(run, step, micro), self.pin)

    def _ahead(self, step: int, micro: int) -> None:
        if self.pool is None:
            return
        accum = self.run.cfg.train.grad_accum
        for _ in range(self.depth):
            step, micro = (step, micro + 1) if micro + 1 < accum else (step + 1, 0)
            if step >= self.run.total_steps:
                return
            if (step, micro) not in self.pending:
                self.pending[(step, micro)] = self.pool.submit(self._prepare, step, micro)
