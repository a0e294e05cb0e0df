"""One record for a batch of pairs' values, from the reference pass to the loss.

``PairValues`` is what the reference pass returns (``cache.build.score_batch``), what
``ShardWriter.add`` takes and ``CacheStore.lookup`` gives back, what training and evaluation
select a micro-batch's reference values from, and what the policy's forward returns
(``scoring.layouts.layout_logprobs``, and ``policy_logps`` for a loop of one's own: the same
record, its tensors carrying the autograd graph).

Each field says how the cache stores it (``stored``): its on-disk dtype, and for per-token
fields the per-pair field holding their counts. The store reads, checks and writes shards from
these declarations only, and a shard tensor is named after its field, so the shard format is
this record's fields. Adding a cached field is: declare it here (optional, ``None`` by
default, so shards written before it still load), compute it where the reference values are
computed (``cache/build.py``'s ``score_batch``), use it where it is needed (``training/objective.py``).
Pairs cached before the field existed are not recomputed for it (``lookup`` gives None for a
field some of the asked pairs lack); a field every value must have is a required one, and then
``cache/store.py``'s ``SCHEMA_VERSION`` moves too (a new namespace: everything is rebuilt).

Shapes (``B`` pairs)::

    chosen_logps         (B,)   float32 sum of completion-token log-probs
    rejected_logps       (B,)   float32
    chosen_tokens        (B,)   int     completion token counts (int32 from the cache, int64 from a forward)
    rejected_tokens      (B,)   int
    chosen_token_logps   B tensors (chosen_tokens[i],)  float32, or None
    rejected_token_logps B tensors (rejected_tokens[i],) float32, or None
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import torch
from torch import Tensor


def completion_sums(flat: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token values of ``B`` pairs' completions, ``flat (M,)`` pair after pair, chosen then
    rejected (``chosen_tokens``/``rejected_tokens (B,)`` of them) → each completion's sum,
    (chosen ``(B,)``, rejected ``(B,)``), in ``flat``'s dtype. Each run summed as a segment, in a
    fixed order: on a GPU the same values in every run, where ``index_add``'s atomic additions
    have none (on a CPU the same values as its sequential sum). ``unsafe``: without the checks
    that the counts are whole and sum to ``M``, each an ``.item()`` (on a GPU a wait for the
    device); the callers' counts are their values' by construction."""
    counts = torch.stack((chosen_tokens, rejected_tokens), dim=1).flatten()  # (2B,) c0, r0, c1, r1, ...
    sums = torch.segment_reduce(flat, "sum", lengths=counts.to(flat.device, non_blocking=True), unsafe=True)
    by_pair = sums.view(-1, 2)  # (B, 2): chosen, rejected
    return by_pair[:, 0], by_pair[:, 1]


def stored(dtype: torch.dtype, counts: str | None = None, optional: bool = False) -> dict:
    """Field metadata: the cache stores the field as ``dtype``; ``counts`` names the per-pair
    count field of a per-token field (stored as one flat tensor, pair after pair)."""
    return {"dtype": dtype, "counts": counts, "optional": optional}


@dataclass
class PairValues:
    """Values of ``B`` pairs (see the module docstring for the fields' shapes)."""

    chosen_logps: Tensor = field(metadata=stored(torch.float32))
    rejected_logps: Tensor = field(metadata=stored(torch.float32))
    chosen_tokens: Tensor = field(metadata=stored(torch.int32))
    rejected_tokens: Tensor = field(metadata=stored(torch.int32))
    chosen_token_logps: list[Tensor] | None = field(
        default=None, metadata=stored(torch.float32, counts="chosen_tokens", optional=True))
    rejected_token_logps: list[Tensor] | None = field(
        default=None, metadata=stored(torch.float32, counts="rejected_tokens", optional=True))

    # ------------------------------------------------------------------------- the schema

    @classmethod
    def pair_fields(cls) -> list[str]:
        """Fields of one value per pair ``(B,)``."""
        return [f.name for f in fields(cls) if f.metadata["counts"] is None]

    @classmethod
    def token_fields(cls) -> list[str]:
        """Per-token fields (a list of ``B`` tensors)."""
        return [f.name for f in fields(cls) if f.metadata["counts"] is not None]

    @classmethod
    def spec(cls, name: str) -> dict:
        return next(f.metadata for f in fields(cls) if f.name == name)

    @property
    def per_token(self) -> bool:
        return self.chosen_token_logps is not None

    def __len__(self) -> int:
        return self.chosen_logps.shape[0]

    # ------------------------------------------------------------------------- batches

    def select(self, idx: Sequence[int] | Tensor) -> "PairValues":
        """The pairs at ``idx`` (positions, or a ``(B,)`` bool mask), in that order."""
        if isinstance(idx, Tensor) and idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        positions = idx.tolist() if isinstance(idx, Tensor) else list(idx)
        index = torch.tensor(positions, dtype=torch.long)
        out = {}
        for name in self.pair_fields():
            value = getattr(self, name)
            out[name] = None if value is None else value[index.to(value.device)]
        for name in self.token_fields():
            value = getattr(self, name)
            out[name] = None if value is None else [value[i] for i in positions]
        return PairValues(**out)

    @classmethod
    def cat(cls, parts: Sequence["PairValues"]) -> "PairValues":
        """``parts`` one after another. A field is kept only if every part has it."""
        out = {}
        for name in cls.pair_fields():
            values = [getattr(p, name) for p in parts]
            out[name] = None if any(v is None for v in values) else torch.cat(values)
        for name in cls.token_fields():
            values = [getattr(p, name) for p in parts]
            out[name] = None if any(v is None for v in values) else [t for v in values for t in v]
        return cls(**out)

    def map(self, fn) -> "PairValues":
        """``fn`` applied to every tensor (per-token ones included)."""
        out = {}
        for name in self.pair_fields():
            value = getattr(self, name)
            out[name] = None if value is None else fn(value)
        for name in self.token_fields():
            value = getattr(self, name)
            out[name] = None if value is None else [fn(t) for t in value]
        return PairValues(**out)

    def to(self, device) -> "PairValues":
        return self.map(lambda t: t.to(device, non_blocking=True))

    def detach(self) -> "PairValues":
        return self.map(Tensor.detach)

    def sums_only(self) -> "PairValues":
        """Without the per-token fields."""
        return replace(self, **{name: None for name in self.token_fields()})

    def finite(self) -> Tensor:
        """``(B,)`` bool: True where every float value of the pair is finite."""
        ok = torch.ones(len(self), dtype=torch.bool)
        for name in self.pair_fields():
            value = getattr(self, name)
            if value is not None and value.is_floating_point():
                ok &= torch.isfinite(value).cpu()
        for name in self.token_fields():
            value = getattr(self, name)
            if value is not None:
                ok &= torch.tensor([bool(torch.isfinite(t).all()) for t in value], dtype=torch.bool)
        return ok

    # ------------------------------------------------------------------------- storage

    def to_tensors(self) -> dict[str, Tensor]:
        """The shard tensors of these values (CPU, each in its stored dtype; per-token fields
        flattened pair after pair). Fields that are None are left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.metadata["counts"] is not None:
                value = torch.cat(list(value)) if len(value) else torch.zeros(0)
            out[f.name] = value.detach().to("cpu", f.metadata["dtype"])
        return out
