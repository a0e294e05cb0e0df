"""The sharded reference's two ``(vocab, hidden)`` tables, used without gathering either whole.

FSDP2 all-gathers a unit whole before it runs, and for a moment holds it twice (the
all-gather buffer and the unsharded parameters). For the input embeddings and the output head
that is a ``(vocab, hidden)`` table each, the largest units of a small or mid-sized model (a
fifth of a 300M Llama's weights). A frozen reference needs neither table whole at once:

- the embedding lookup copies rows: the table's rows are broadcast tile by tile from the rank
  whose shard holds them (``RowTiles``), and every rank copies from each tile the rows its ids
  pick. Rows are copied, not computed, so the values are the whole table's.
- the head's logits ``(..., vocab)`` are computed a tile of vocabulary rows at a time into
  one output buffer: each logit is its own dot product over the hidden size, so the tiles give
  the products of one matrix product with the whole weight (checked on CPU for fp32, bf16 and
  the fp32-GEMM route of ``dpocache.scoring.bf16_matmul``); the caller reduces them as before.

So besides its shards a process holds one tile (8 MiB) of a table, and the tables travel once
per use, as an all-gather would send them. Every rank must take part in every tile's
broadcast: the embeddings are called once per body forward, and body forwards are in step
(``dpocache.distributed.sharded_reference``); the head is called once per row chunk, and a rank's chunk count
depends on its batch, so each call is one round (an all-reduce of a flag, then the tiles) and
``StreamedHead.finish`` runs tile rounds that compute nothing until no rank has a call left,
as ``ShardedReference.drain`` does for whole forwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpocache.distributed.process_group import DistEnv, reduce_counts
from dpocache.models.loading import shard_rows
from dpocache.scoring import bf16_matmul

TILE_BYTES = 8 << 20


class RowTiles:
    """A table whose dim 0 is split over the ranks as FSDP2 splits it (``local``: this
    rank's rows), iterated as ``(start, stop, tile)``: every rank gets every tile, each
    broadcast by the rank that holds it (a collective: every rank iterates to the end)."""

    def __init__(self, local: torch.Tensor, rows: int, env: DistEnv):
        self.local, self.rows, self.env = local, rows, env
        row_bytes = max(1, local.shape[1:].numel() * local.element_size())
        self.tile_rows = max(1, TILE_BYTES // row_bytes)

    def __iter__(self):
        world, rank = self.env.world_size, self.env.rank
        for owner in range(world):
            owned = shard_rows(self.rows, world, owner)
            # Tiles of equal size (within one row): no tail of a few rows, which a matrix
            # product may compute with another kernel (a matrix-vector one for a single row).
            count = -(-(owned.stop - owned.start) // self.tile_rows)
            size = -(-(owned.stop - owned.start) // max(1, count))
            for start in range(owned.start, owned.stop, max(1, size)):
                stop = min(owned.stop, start + size)
                if owner == rank:
                    tile = self.local[start - owned.start:stop - owned.start]
                else:
                    tile = self.local.new_empty((stop - start, *self.local.shape[1:]))
                if world > 1:
                    dist.broadcast(tile, src=owner)
                yield start, stop, tile


class StreamedEmbedding(nn.Module):
    """Stands in for a sharded ``nn.Embedding``: ``ids (...)`` → ``(..., hidden)``, the rows of
    the whole ``(rows, hidden)`` table, of which ``shard`` holds this rank's share."""

    def __init__(self, shard: torch.Tensor, rows: int, env: DistEnv):
        super().__init__()
        self.shard = nn.Parameter(shard, requires_grad=False)  # (rows of this rank, hidden)
        self.num_embeddings, self.embedding_dim = rows, shard.shape[1]
        self.tiles = RowTiles(self.shard, rows, env)

    @classmethod
    def from_sharded(cls, embedding: nn.Embedding, env: DistEnv) -> StreamedEmbedding:
        """From a loaded FSDP2 unit (its weight a ``DTensor``)."""
        if embedding.max_norm is not None:
            raise ValueError("a streamed embedding cannot renormalise rows (max_norm)")
        return cls(embedding.weight.to_local(), embedding.num_embeddings, env)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.shard.new_zeros((*ids.shape, self.embedding_dim))  # (..., hidden)
        for start, stop, tile in self.tiles:
            picked = (ids >= start) & (ids < stop)
            if picked.any():
                out[picked] = tile[ids[picked] - start]
        return out


class StreamedHead(nn.Module):
    """Stands in for a sharded bias-free ``nn.Linear`` output head: ``h (..., hidden)`` →
    ``(..., vocab)`` logits, a tile of vocabulary rows at a time, of which ``shard`` holds this
    rank's share; ``routed``: through ``dpocache.scoring.bf16_matmul``'s fp32 GEMM, as the head was.
    Each call is one round; call ``finish`` on every rank after each forward's head calls."""

    def __init__(self, shard: torch.Tensor, vocab: int, env: DistEnv, routed: bool = False):
        super().__init__()
        self.shard = nn.Parameter(shard, requires_grad=False)  # (vocabulary rows of this rank, hidden)
        self.in_features, self.out_features = shard.shape[1], vocab
        self.routed, self.env = routed, env
        self.tiles = RowTiles(self.shard, vocab, env)

    @classmethod
    def from_sharded(cls, head: nn.Linear, env: DistEnv) -> StreamedHead:
        """From a loaded FSDP2 unit (its weight a ``DTensor``), after ``bf16_matmul.install``."""
        if head.bias is not None:
            raise ValueError("a streamed head has no bias")
        routed = bf16_matmul.installed(head)
        return cls(head.weight.to_local(), head.out_features, env, routed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self._round(working=True)
        out = None
        for start, stop, tile in self.tiles:
            logits = bf16_matmul.linear(h, tile) if self.routed else F.linear(h, tile)  # (..., stop - start)
            if out is None:
                out = logits.new_empty((*h.shape[:-1], self.out_features))
            out[..., start:stop] = logits
        return out

    def _round(self, working: bool) -> bool:
        """One round's flag: whether any rank calls the head in this round."""
        (calls,) = reduce_counts(self.env, [1.0 if working else 0.0])
        return calls > 0

    def finish(self) -> None:
        """Tile rounds that compute nothing until no rank has a head call left (a collective)."""
        while self._round(working=False):
            for _ in self.tiles:
                pass
