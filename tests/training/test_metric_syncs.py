"""Host synchronisations of the training loop: no micro-batch waits for the device (metric sums
stay device tensors, and no op of its forward or loss reads a value back), an optimizer step
waits once whatever its micro-batch count, and a logging window is read with one
synchronisation, to the same values as the plain float sums it replaced."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from train_fixtures import base_model, flags, one_thread, run_training, train_jsonl  # noqa: F401 (fixtures)

from dpocache.distributed.process_group import DistEnv
from dpocache.training import loop as train_mod
from dpocache.training.metrics import MetricWindow

# Tensor methods that make the host wait for the device (on a GPU); on the CPU they are counted all the same.
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


class SyncCounter:
    """Counts calls of ``SYNCS`` made from dpocache's own code while ``active``."""

    def __init__(self, monkeypatch):
        self.active = False
        self.calls: list[str] = []
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            if self.active:
                caller = sys._getframe(1)
                module = caller.f_globals.get("__name__", "")
                if module.startswith("dpocache"):
                    self.calls.append(f"{module}:{caller.f_lineno} {name}")
            return original(tensor, *args, **kwargs)

        return counted


def _syncs_per_step(tmp_path, monkeypatch, model, data, grad_accum: int) -> list[list[str]]:
    """The reads of device values by each optimizer step of a 4-step run that logs at its last:
    the step itself and the loop's decision after it (save, stop)."""
    counter = SyncCounter(monkeypatch)
    real_step, real_decision = train_mod.train_step, train_mod._save_or_stop
    per_step = []

    def counted(real, new_step: bool):
        def call(*args):
            counter.active = True
            if new_step:
                per_step.append([])
            try:
                return real(*args)
            finally:
                counter.active = False
                per_step[-1] += counter.calls
                counter.calls = []

        return call

    monkeypatch.setattr(train_mod, "train_step", counted(real_step, True))
    monkeypatch.setattr(train_mod, "_save_or_stop", counted(real_decision, False))
    run_training(*flags(model, data, tmp_path / f"run{grad_accum}", tmp_path / "cache", "--batch-size", "2",
                        "--grad-accum", str(grad_accum), "--max-steps", "4", "--logging-steps", "4"))
    monkeypatch.undo()
    return per_step


def test_one_sync_per_step(tmp_path, monkeypatch, base_model, train_jsonl):  # noqa: F811
    one = _syncs_per_step(tmp_path, monkeypatch, base_model, train_jsonl, grad_accum=1)
    four = _syncs_per_step(tmp_path, monkeypatch, base_model, train_jsonl, grad_accum=4)
    # Step 1 audits its first micro-batch against the cache (dpocache.training.audit): later steps only.
    print("\nper step, grad_accum 1:", one[1:], "\nper step, grad_accum 4:", four[1:])
    assert len(one) == len(four) == 4
    assert one[1:] == four[1:]  # nothing scales with the micro-batches
    # The step's one wait: its NaN flag, its gradient norm and the last step's weights' norm
    # together (divergence); the loop's save and stop decision waits for nothing in one process.
    assert all(len(calls) == 1 and calls[0].startswith("dpocache.training.loop:") for calls in four[1:]), four


# Ops whose result's size or value the host must read back (on a GPU, each waits for the device).
DATA_DEPENDENT = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique", "_unique2",
                  "unique_consecutive", "unique_dim", "is_nonzero", "equal"}


class DataDependentOps(TorchDispatchMode):
    """Records the ops run under it that read a device value back to the host: those of
    ``DATA_DEPENDENT``, an index by a boolean mask, and ``repeat_interleave`` without its
    ``output_size``; each as ``op < module`` of the code that called it (the first frame outside
    torch). On this CPU every tensor is a host tensor, so they are caught by name."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    @staticmethod
    def _caller() -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("torch", __name__):
            frame = frame.f_back
        return frame.f_globals.get("__name__", "?") if frame is not None else "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        sized = name == "repeat_interleave" and kwargs.get("output_size") is None
        if name in DATA_DEPENDENT or bool_index or sized:
            self.seen.append(f"{func} < {self._caller()}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("options", [(), ("--attention", "causal"), ("--loss.ld_alpha", "0.5"),
                                     ("--loss.use_weighting", "true"), ("--loss.rpo_alpha", "1.0"),
                                     ("--train.layout", "shared"), ("--train.layout", "padded"),
                                     ("--train.layout", "padded", "--loss.use_weighting", "true")],
                         ids=["packed", "causal-rows", "ld-dpo", "wpo", "rpo", "shared", "padded", "padded-wpo"])
def test_a_micro_batch_reads_nothing_back_from_the_device(tmp_path, monkeypatch, base_model, train_jsonl,  # noqa: F811
                                                          options):
    """A micro-batch's forward, head, loss and metrics run no op that reads a device value back,
    in every layout: the padded layout's scored positions come from its collate, on the host.
    Its one exception is transformers' own: building the causal mask from a padding mask, it
    asks whether any token is padding (``masking_utils``), as it does for every trainer."""
    real, seen = train_mod.batch_losses, []

    def watched(run, batch, window, prefix="", check_cache=False):
        if check_cache:  # step 1's audit compares with the cache on the host, once (training.audit)
            return real(run, batch, window, prefix, check_cache)
        with DataDependentOps() as mode:
            out = real(run, batch, window, prefix, check_cache)
        seen.extend(mode.seen)
        return out

    monkeypatch.setattr(train_mod, "batch_losses", watched)
    run_training(*flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--batch-size", "2",
                        "--max-steps", "2", "--train.layout", "packed", *options))
    padded = "padded" in options
    assert [op for op in seen if not (padded and op.endswith("< transformers.masking_utils"))] == [], seen


def test_the_data_dependent_op_detector_sees_a_boolean_selection():
    x = torch.arange(6.0)
    with DataDependentOps() as mode:
        x[x > 2].sum()
        x.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]))
        x.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]), output_size=6)  # sized: not read back
    assert len(mode.seen) == 2, mode.seen


def test_window_reads_once_and_equals_float_sums(monkeypatch):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(b, generator=g) * 10 for b in (3, 5, 4)]
    window = MetricWindow()
    for values in batches:
        window.add_mean("loss", values)
        window.add_mean("scaled", values * 1e-3)
    window.add("grad_norm", torch.tensor(2.5), 1.0)
    window.add("grad_norm", torch.tensor(0.5), 1.0)
    window.add("lr", 1e-3, 1.0)
    window.add_total("tokens", 17.0)
    # The values the window logged when it added Python floats (float(sum) per micro-batch).
    expected_loss = 0.0
    expected_scaled = 0.0
    for values in batches:
        expected_loss += float(values.float().sum())
        expected_scaled += float((values * 1e-3).float().sum())
    counter = SyncCounter(monkeypatch)
    counter.active = True
    got = window.reduce(DistEnv())
    counter.active = False
    assert len(counter.calls) == 1, counter.calls  # one tolist for the whole window
    assert got["loss"] == expected_loss / 12 and got["scaled"] == expected_scaled / 12  # exactly
    assert got["grad_norm"] == 1.5 and got["lr"] == 1e-3 and got["tokens"] == 17.0


@pytest.mark.parametrize("name", ["item", "__float__"])
def test_counter_sees_dpocache_calls_only(monkeypatch, name):
    counter = SyncCounter(monkeypatch)
    counter.active = True
    getattr(torch.ones(()), name)()  # a call from a test module: not counted
    counter.active = False
    assert counter.calls == []
