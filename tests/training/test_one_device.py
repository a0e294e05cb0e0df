"""Everything a micro-batch computes lives on the run's device: the policy's log-probs, the
token counts they are normalised by, the reference values, the losses and the metric sums. A
host tensor mixed in is an error on a GPU (``index_add(): self, index and source expected to be
in the same device``) that a CPU-only run never sees; PyTorch's ``meta`` device, which is not
the host either, makes it show here. The objective runs on it for each layout and the loss
options that add terms of their own, forward and backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from train_fixtures import base_model, flags, one_thread, run_training, train_jsonl  # noqa: F401 (fixtures)

from dpocache.training import loop as train_mod
from dpocache.training.metrics import MetricWindow
from dpocache.training.objective import batch_losses
from dpocache.training.prefetch import prepare, step_indices

META = torch.device("meta")


class _Checked(Exception):
    pass


@pytest.mark.parametrize("options", [("--train.layout", "packed"), ("--train.layout", "shared"),
                                     ("--train.layout", "padded"), ("--attention", "causal"),
                                     ("--loss", "simpo"), ("--loss.ld_alpha", "0.5"),
                                     ("--loss.use_weighting", "true"), ("--loss.rpo_alpha", "1.0"),
                                     ("--train.layout", "padded", "--loss.use_weighting", "true"),
                                     ("--lora-r", "4", "--gradient-checkpointing", "true")],
                         ids=["packed", "shared", "padded", "causal-rows", "simpo", "ld-dpo", "wpo", "rpo",
                              "padded-wpo", "lora-checkpointed"])
def test_a_micro_batch_computes_on_the_run_device_only(tmp_path, monkeypatch, base_model, train_jsonl,  # noqa: F811
                                                       options):
    import transformers.masking_utils as masking

    # transformers reads whether a padding mask pads anything (a value meta has not got): the mask is built instead.
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    seen = {}

    def on_meta(run, window):
        run = dataclasses.replace(run, env=dataclasses.replace(run.env, device=META))
        run.scorer.to(META)
        micro = prepare(run, run.train_data, run.ref_train, step_indices(run, 0, 0))
        metrics = MetricWindow()
        losses, aux, (pairs, pc, pr, rc, rr) = batch_losses(run, micro, metrics)
        losses.mean().backward()
        seen["tensors"] = {"losses": losses, "policy": pc, **({"reference": rc} if rc is not None else {}),
                           **{name: s for name, s in metrics.sums.items() if isinstance(s, torch.Tensor)}}
        seen["grads"] = [p.grad for p in run.policy.parameters() if p.requires_grad]
        raise _Checked

    monkeypatch.setattr(train_mod, "train_step", on_meta)
    with pytest.raises(_Checked):
        run_training(*flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--batch-size", "2",
                            "--max-steps", "1", *options))
    assert {name: t.device for name, t in seen["tensors"].items() if t.device != META} == {}
    assert "loss" in seen["tensors"] and seen["grads"] and all(g is not None and g.device == META
                                                               for g in seen["grads"])
