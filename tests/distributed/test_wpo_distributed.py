"""WPO (``--loss.use_weighting``) under DDP and FSDP2: 2 CPU ranks on gloo give the losses and
weights of one process with the global batch. The head's extra output is computed inside the
wrapped scorer's forward, so the wrappers' hooks (gradient reduction, parameter all-gather) run
around it as around the log-probs."""

from __future__ import annotations

import pytest
import torch
from test_distributed import assert_close_records, evals, losses, torchrun, train_args, train_in_process

from dpocache.data.rows import write_jsonl
from dpocache.models.tiny import save_tiny_model
from dpocache.training.demo import sorting_pairs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
]

WPO = ("--loss.use_weighting", "true", "--max-steps", "2", "--save-steps", "0")
KEYS = ("loss", "grad_norm", "rewards/margins", "wpo/weights")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wpo-dist")
    return {
        "root": root,
        "model": save_tiny_model(root / "policy", "llama", seed=0),
        "ref": save_tiny_model(root / "ref", "llama", seed=1),  # another reference: the loss is not log 2
        "train": write_jsonl(sorting_pairs(32, 12), root / "train.jsonl"),
        "eval": write_jsonl(sorting_pairs(11, 13), root / "eval.jsonl"),
        "cache": root / "cache",
    }


@pytest.fixture(scope="module")
def single_run(assets):
    out = assets["root"] / "single"
    train_in_process(train_args(assets, out, 8, None, *WPO))  # builds the cache the ranks then read
    return out


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(assets, single_run, mode):
    out = assets["root"] / mode
    torchrun("train", *train_args(assets, out, 4, None, *WPO, *(["--fsdp"] if mode == "fsdp" else [])))
    got, want = losses(out), losses(single_run)
    assert sorted(got) == sorted(want) == [1, 2]
    assert abs(want[1]["wpo/weights"] - 1) > 1e-3  # the weights are not trivially 1
    for step in (1, 2):
        assert_close_records(got[step], want[step], keys=KEYS)
    for g, w in zip(evals(out), evals(single_run), strict=True):
        assert_close_records(g, w, keys=("eval/loss", "eval/wpo/weights"))
