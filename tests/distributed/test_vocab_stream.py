"""dpocache.distributed.vocab_stream on several processes (gloo): the streamed embeddings give the whole
table's rows exactly, the streamed head the whole weight's logits, and ranks whose head-call
counts differ stay in step."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from dpocache.distributed.process_group import DistEnv
from dpocache.models.loading import shard_rows

VOCAB, HIDDEN = 37, 8  # 37 rows over 3 ranks: 13, 13, 11 (uneven shares)


def _table(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _rank(rank: int, world: int, init: str, calls: list[int]) -> None:
    from dpocache.distributed import vocab_stream
    from dpocache.distributed.vocab_stream import StreamedEmbedding, StreamedHead

    torch.set_num_threads(1)  # as torchrun sets it
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        env = DistEnv(rank=rank, world_size=world)
        vocab_stream.TILE_BYTES = 5 * HIDDEN * 4  # tiles of 5 rows: several per share, the last one short
        embedding, weight = _table(0), _table(1)
        own = shard_rows(VOCAB, world, rank)
        embed = StreamedEmbedding(embedding[own].clone(), VOCAB, env)
        head = StreamedHead(weight[own].clone(), VOCAB, env)
        assert embed.tiles.tile_rows == 5

        ids = torch.randint(0, VOCAB, (2 + rank, 7), generator=torch.Generator().manual_seed(rank))
        assert torch.equal(embed(ids), F.embedding(ids, embedding))  # rows copied, exactly
        for call in range(calls[rank]):  # a different number of head calls on each rank
            h = torch.randn(3 + call, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + call))
            # Tiles of 5 rows against one product of 37: a matrix product of this tiny size
            # rounds differently by width; on a model's sizes they are equal (test_loading).
            torch.testing.assert_close(head(h), F.linear(h, weight), rtol=0, atol=1e-6)
        head.finish()
        assert torch.equal(embed(ids), F.embedding(ids, embedding))  # the next forward is in step again
    finally:
        dist.destroy_process_group()


def test_streamed_tables_are_exact_and_in_step_with_unequal_head_calls(tmp_path):
    world = 3
    mp.spawn(_rank, args=(world, f"file://{tmp_path / 'pg'}", [3, 0, 1]), nprocs=world, join=True)
