"""``runtime.lookahead.ahead``: the next item prepared on a background thread, in order, with
errors raised at their item and nothing left running after an early stop; on a GPU, the
reference pass's batches laid out ahead give exactly the values of batches laid out in turn."""

from __future__ import annotations

import threading

import pytest
import torch

from dpocache.runtime.lookahead import ahead


def _record(threads):
    def prepare(x):
        threads.append(threading.current_thread().name)
        return x * 10

    return prepare


@pytest.mark.parametrize("background", [True, False])
def test_items_come_in_order_with_what_was_prepared(background):
    threads = []
    assert list(ahead(range(5), _record(threads), background)) == [(i, i * 10) for i in range(5)]
    on_thread = [name.startswith("dpocache-lookahead") for name in threads]
    assert all(on_thread) if background else not any(on_thread)
    assert list(ahead([], _record([]), background)) == []


def test_the_next_item_is_prepared_while_the_caller_works():
    started = {i: threading.Event() for i in range(4)}

    def prepare(x):
        started[x].set()
        return x

    for item, _ in ahead(range(3), prepare):
        # While the caller still holds this item, the next one's preparation has begun (sequential
        # code would start it only after the caller moves on: the wait would time out).
        if item + 1 < 3:
            assert started[item + 1].wait(timeout=30), f"item {item + 1} was not prepared ahead"


def test_an_error_comes_out_at_its_item_and_an_early_stop_leaves_no_thread():
    def prepare(x):
        if x == 2:
            raise ValueError("bad item 2")
        return x

    seen = []
    with pytest.raises(ValueError, match="bad item 2"):
        for item, _ in ahead(range(5), prepare):
            seen.append(item)
    assert seen == [0, 1]
    before = threading.active_count()
    loop = ahead(range(100), lambda x: x)
    for item, _ in loop:
        if item == 3:
            break
    loop.close()
    assert threading.active_count() <= before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_batches_laid_out_ahead_score_as_batches_laid_out_in_turn(tmp_path):
    from dpocache.cache.build import laid_out_ahead, reference_batches, score_batch
    from dpocache.data.pairs import TokenizedPair
    from dpocache.models.reference import ReferenceModel
    from dpocache.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    reference = ReferenceModel.from_pretrained(model, "bfloat16", "cuda")
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return tuple(torch.randint(3, 300, (n,), generator=g).tolist())

    pairs = [TokenizedPair(i, ids(20 + i), ids(5 + i % 7), ids(9 - i % 5), key=bytes([i]) * 16) for i in range(24)]
    batches = reference_batches(reference, pairs, 256)
    assert len(batches) > 2
    plain = [score_batch(reference, batch, 0, 256) for batch in batches]
    ahead_values = [score_batch(reference, batch, 0, 256, laid)
                    for batch, laid in laid_out_ahead(reference, batches, 0, 256)]
    for a, b in zip(plain, ahead_values):
        assert torch.equal(a.chosen_logps, b.chosen_logps) and torch.equal(a.rejected_logps, b.rejected_logps)
