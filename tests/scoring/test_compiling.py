"""``--compile``: the reference pass with its decoder layers compiled (dpocache.scoring.compiling)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import needs_cpu_compile
from train_fixtures import base_model, flags, one_thread, run_json, run_training, train_jsonl, train_records  # noqa: F401

from dpocache.cache.build import score_batch
from dpocache.cli.entry import main
from dpocache.models.reference import ReferenceModel
from dpocache.scoring.compiling import compiler_mark, compiler_since, AUTO_MIN_WORK, compile_layers, should_compile
from dpocache.scoring.layouts import budget_batches
from dpocache.scoring.logprobs import decoder_layers


def test_auto_compiles_only_a_pass_long_enough_where_it_was_measured_to_pay(monkeypatch):
    import dpocache.scoring.compiling as compiling

    monkeypatch.setattr(compiling, "cpu_compile_blocked", lambda: None)  # the rule, wherever torch lives
    bf16, fp32 = torch.bfloat16, torch.float32
    gpu = int(AUTO_MIN_WORK["cuda", bf16] // 10**9) + 1  # tokens whose work at 1e9 parameters reaches it
    assert should_compile("auto", "cuda", bf16, gpu, 10**9)
    assert not should_compile("auto", "cuda", bf16, gpu // 4, 10**9)  # repays less than twice its compile
    cpu = int(AUTO_MIN_WORK["cpu", fp32] // 10**8) + 1
    assert should_compile("auto", "cpu", fp32, cpu, 10**8) and not should_compile("auto", "cpu", fp32, cpu // 4, 10**8)
    # Not measured: CPU bf16 (its linear layers go through dpocache.scoring.bf16_matmul) and CUDA fp32.
    assert not should_compile("auto", "cpu", bf16, 100 * cpu, 10**8)
    assert not should_compile("auto", "cuda", fp32, 100 * gpu, 10**9)
    assert should_compile("on", "cpu", bf16, 1, 1) and not should_compile("off", "cuda", bf16, 100 * gpu, 10**9)
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        should_compile("yes", "cuda", bf16, 1, 1)


def test_a_cpu_that_cannot_compile_runs_eager_on_auto_and_says_so_on_on(monkeypatch, tokenizer):
    """torch installed under a path with a space cannot link CPU kernels: --compile auto stays
    eager there, and --compile on is one line naming why (it was a linker error per kernel)."""
    import dpocache.scoring.compiling as compiling
    from dpocache.models.tiny import build_model
    from dpocache.runtime.preflight import UsageError

    monkeypatch.setattr(compiling, "cpu_compile_blocked", lambda: "torch is installed under a path with a space")
    work = int(AUTO_MIN_WORK["cpu", torch.float32] // 10**8) + 1
    assert not should_compile("auto", "cpu", torch.float32, 100 * work, 10**8)
    assert should_compile("auto", "cuda", torch.bfloat16, 10**9, 10**9)  # a GPU's kernels are not linked so
    with pytest.raises(UsageError, match="--compile on: torch is installed under a path with a space"):
        compile_layers(build_model("llama", tokenizer))


@needs_cpu_compile
def test_compile_layers_compiles_every_decoder_layer_in_place(tokenizer):
    from dpocache.models.tiny import build_model

    model = build_model("llama", tokenizer)  # its own: the session's tiny models must not be compiled
    layers = decoder_layers(model)
    before = [id(layer) for layer in layers]
    assert compile_layers(model) == len(layers) > 0
    # In place: the same modules (their parameters and state dict unchanged), calls go through the compiled forward.
    assert [id(layer) for layer in decoder_layers(model)] == before
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert compile_layers(torch.nn.Linear(2, 2)) == 0  # no decoder: nothing to compile


@needs_cpu_compile
@pytest.mark.slow
def test_compiled_reference_pass_equals_eager_in_fp32(model_dir, data):
    """The compiled layers (inductor, CPU) against the eager model, per pair, in both layouts;
    batches of several shapes, which the one dynamic-shape graph serves without a recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    for layout in ("shared", "padded"):
        eager = ReferenceModel.from_pretrained(model_dir, "float32", "cpu", layout=layout)
        compiled = ReferenceModel.from_pretrained(model_dir, "float32", "cpu", layout=layout, compile="on")
        assert eager.compiled_layers == 0 and compiled.compiled_layers == len(decoder_layers(compiled.model))
        batches = budget_batches(data.pairs[:24], 256, layout=compiled.layout)[:3]
        assert len({max(p.num_tokens for p in b) for b in batches}) > 1  # several shapes
        for batch in batches:
            want, got = score_batch(eager, batch, 0), score_batch(compiled, batch, 0)
            for side in ("chosen_token_logps", "rejected_token_logps"):  # per token, as every layout test
                torch.testing.assert_close(torch.cat(getattr(got, side)), torch.cat(getattr(want, side)),
                                           rtol=0, atol=1e-5)
        if layout == "shared":  # compiled once for its three shapes (automatic dynamic compiled twice)
            assert counters["stats"]["unique_graphs"] - graphs == 1


def test_build_summary_names_compiled_layers_and_bad_value_is_status_2(tmp_path, model_dir, pref_jsonl, capsys):
    args = ["cache", "build", "--model", str(model_dir), "--data", str(pref_jsonl), "--cache-dir", str(tmp_path),
            "--dtype", "float32", "--device", "cpu", "--json"]
    assert main([*args, "--compile", "sometimes"]) == 2
    assert "--compile (model.compile): must be one of auto, on, off; got 'sometimes'" in capsys.readouterr().err
    assert main(args) == 0  # auto, a short pass: eager
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["compiled_layers"] == 0


@needs_cpu_compile
@pytest.mark.slow
def test_training_with_compiled_layers_follows_the_eager_run(tmp_path, base_model, train_jsonl, cli):
    """Three fp32 steps with the policy's layers compiled (forward and backward through inductor)
    against the same run eager: the same losses and gradient norms, up to fp32 rounding; run.json
    records the one graph compiled, and the command's summary says it (the eager run's says
    nothing of it)."""
    from transformers import AutoConfig

    torch._dynamo.reset()
    layers = AutoConfig.from_pretrained(base_model).num_hidden_layers
    runs = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        rc, stdout, err = cli("train", *flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "3",
                                              "--compile", mode))
        assert rc == 0, err
        said = [line for line in stdout.splitlines() if line.startswith("compiled:")]
        assert said == ([] if mode == "off" else [f"compiled: {layers} decoder layers into 1 graph, no graph break "
                                                  "(why each: run.json policy.compiler)"])
        runs[mode] = train_records(out)
        policy = run_json(out)["policy"]
        assert policy["compiled_layers"] == (0 if mode == "off" else layers)
        # one dynamic graph for every layer and batch shape, and no break (None: nothing compiled)
        if mode == "off":
            assert "compiler" not in policy
        else:
            assert policy["compiler"] == {"graphs": 1, "graph_breaks": 0, "recompile_reasons": [],
                                          "graph_break_reasons": []}
    assert len(runs["on"]) == len(runs["off"]) == 3
    for eager, compiled in zip(runs["off"], runs["on"]):
        assert compiled["loss"] == pytest.approx(eager["loss"], abs=1e-5)
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-4)


def test_compiler_since_counts_this_runs_graphs_and_says_why_it_recompiled():
    """``compiler_since`` tells apart what the compiler did after a mark: a function compiled
    before it is not counted; one compiled after it, then called with autograd off and with a
    tensor of another dtype, counts three graphs, and its two recompiles name the guards that
    failed (grad mode, dtype); a graph break names its reason."""
    def scale(x):
        return x * 2

    def broken(x):
        torch._dynamo.graph_break()
        return x + 1

    before = torch.compile(scale, backend="eager")
    before(torch.ones(3))
    mark = compiler_mark()
    before(torch.ones(3))  # compiled before the mark: nothing new
    assert compiler_since(mark) == {"graphs": 0, "graph_breaks": 0, "recompile_reasons": [], "graph_break_reasons": []}

    def scale_again(x):
        return x * 3

    after = torch.compile(scale_again, backend="eager")
    after(torch.ones(3))
    with torch.no_grad():
        after(torch.ones(3))
    after(torch.ones(3, dtype=torch.float64))
    torch.compile(broken, backend="eager")(torch.ones(3))
    got = compiler_since(mark)
    assert got["graphs"] >= 4 and got["graph_breaks"] >= 1, got
    reasons = [r for r in got["recompile_reasons"] if r.startswith("scale_again (test_compiling.py:")]
    assert len(reasons) == 2 and "grad_mode" in reasons[0] and "dtype mismatch" in reasons[1], got
    assert not any(r.startswith("scale (") for r in got["recompile_reasons"]), got
    assert got["graph_break_reasons"] and all(got["graph_break_reasons"]), got
