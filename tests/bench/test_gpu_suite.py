"""``bench/gpu_suite.py``: its ``--dry-run`` (every row, both systems each in its own process,
at tiny shapes on the CPU) writes the result's schema, so the GPU suite keeps working between
the sessions that have a GPU; ``--merge`` joins parts of one device and refuses others."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_suite  # noqa: E402

SCHEMA = ("name", "tokens_per_s", "mfu", "trl_tokens_per_s", "vs_trl", "peak_mem_gib", "trl_peak_mem_gib",
          "mem_vs_trl")
HEADER = ("device", "torch", "transformers", "trl", "date", "command", "rows")


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # 12 worker processes: about 70 s on 2 idle cores
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the suite measures against TRL")
def test_dry_run_writes_every_row_of_the_schema(tmp_path):
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_suite.py"), "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--profile"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(HEADER) <= set(result)
    assert result["dry_run"] is True and result["device_slug"] == "cpu-dryrun"
    assert result["command"][:2] == ["python", "bench/gpu_suite.py"]
    assert str(tmp_path) not in out.read_text()  # no machine path in a result
    assert [row["name"] for row in result["rows"]] == list(gpu_suite.ROWS)
    for row in result["rows"]:
        assert set(SCHEMA) <= set(row), row["name"]
        assert "error" not in row, row["error"]
        for key in ("tokens_per_s", "trl_tokens_per_s", "vs_trl", "mfu", "peak_mem_gib", "trl_peak_mem_gib",
                    "mem_vs_trl"):
            assert _finite_positive(row[key]), (row["name"], key, row[key])
        assert set(row["met"]) == set(gpu_suite.TARGETS[row["name"]])
        assert row["raw"]["dpocache"] and row["raw"]["trl"]
        # --profile: dpocache's side under torch.profiler (the pass once more, or a training run's
        # steps after its timed ones), its kernel table beside the result, the host's time per step
        # or pass in the row
        profiled = row["raw"]["dpocache"]["profile"]
        assert profiled["profiled_steps"] >= 1 and _finite_positive(profiled["profiled_host_op_s_per_step"])
        assert "aten::mm" in (tmp_path / "x-profiles" / profiled["table"]).read_text()
    ref = result["rows"][0]["raw"]["token_counts"]
    assert ref["data"] == ref["dpocache"] == ref["trl"]  # both systems count the same real tokens
    for row in result["rows"][1:]:
        # the same pairs, the same count: each system's tokens over all its steps are the data's
        assert sum(row["raw"]["dpocache"]["step_tokens"]) == sum(row["raw"]["trl"]["step_tokens"])
        assert row["raw"]["dpocache"]["reference_pairs"]["computed"] == 0  # from the cache built before
        # each side's steps after the warmup timed as one window, synchronised at its ends only
        warmup = row["setup"]["warmup_steps"]
        for side in ("dpocache", "trl"):
            timed = row["raw"][side]
            assert timed["timed_from"] == warmup and _finite_positive(timed["window_s"]), (row["name"], side)
            tokens = sum(timed["step_tokens"][warmup:])
            expected = row["tokens_per_s" if side == "dpocache" else "trl_tokens_per_s"]
            assert expected == pytest.approx(tokens / timed["window_s"])
            assert len(timed["step_s"]) == len(timed["step_tokens"]) == row["setup"]["steps"], (row["name"], side)
        # the profiled steps ran after the timed ones, in the same process, and are not among them
        assert len(row["raw"]["dpocache"]["profile"]["tokens"]) == row["raw"]["dpocache"]["profile"]["profiled_steps"]
    # ref-8b's cache holds the LoRA row's pairs (its data is the start of ref-8b's): its build is a hit
    assert result["rows"][1]["raw"]["dpocache_reference_build"]["summary"]["computed"] == 0
    # the LoRA row's own options (the dry run's: checkpointed, its recompute skipping the down
    # projections' products; a GPU's also streams and compiles), as run.json says
    lora = result["rows"][1]
    assert lora["setup"]["dpocache_args"][-2:] == ["--gradient-checkpointing", "true"]
    assert lora["raw"]["dpocache"]["ran"]["kept_products"] is None
    assert lora["raw"]["dpocache"]["ran"]["skipped_products"] == {"names": ["down_proj"], "linear_layers": 2}
    assert lora["raw"]["dpocache"]["streamed_window"] is None  # its base streams on a GPU only


def _part(tmp_path: Path, name: str, rows: list[dict], device: str = "NVIDIA H100 80GB HBM3") -> Path:
    part = {"device": device, "device_slug": gpu_suite.device_slug(device), "torch": "2.11.0+cu130",
            "transformers": "5.17.0", "trl": "1.16.0", "peft": "0.21.2", "dry_run": False, "kernels": "auto",
            "date": f"2026-12-01T0{len(name)}:00:00+0000", "command": ["python", "bench/gpu_suite.py", "--only"],
            "rows": rows}
    path = tmp_path / name
    path.write_text(json.dumps(part))
    return path


def _row(name: str, tps: float = 100.0, error: str | None = None) -> dict:
    row = dict.fromkeys(SCHEMA[2:], None) | {"name": name, "tokens_per_s": tps}
    return row | ({"error": error} if error else {})


def test_merge_joins_parts_in_row_order(tmp_path):
    a = _part(tmp_path, "a.json", [_row("train-1b-full"), _row("ref-8b", error="trl-precompute: out of memory")])
    b = _part(tmp_path, "bb.json", [_row("ref-8b", 200.0), _row("train-8b-lora")])
    out = tmp_path / "merged.json"
    assert gpu_suite.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [r["name"] for r in merged["rows"]] == list(gpu_suite.ROWS)
    assert merged["rows"][0]["tokens_per_s"] == 200.0 and "error" not in merged["rows"][0]  # the failed part replaced
    assert [p["file"] for p in merged["parts"]] == ["a.json", "bb.json"]
    assert merged["date"] == "2026-12-01T07:00:00+0000"  # the later part's
    assert merged["device"] == "NVIDIA H100 80GB HBM3"


def test_merge_refuses_another_device_and_a_row_measured_twice(tmp_path, capsys):
    a = _part(tmp_path, "a.json", [_row("ref-8b")])
    other = _part(tmp_path, "h200.json", [_row("train-8b-lora")], device="NVIDIA H200")
    with pytest.raises(ValueError, match="device 'NVIDIA H200'"):
        gpu_suite.merge_parts([a, other])
    again = _part(tmp_path, "again.json", [_row("ref-8b")])
    with pytest.raises(ValueError, match="row ref-8b"):
        gpu_suite.merge_parts([a, again])
    assert gpu_suite.main(["--merge", str(a), str(other), "--out", str(tmp_path / "m.json")]) == 2
    assert "NVIDIA H200" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
    assert gpu_suite.main(["--merge", str(a), str(again)]) == 2  # --out is required


def test_device_slug_and_peaks():
    assert gpu_suite.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_suite.device_slug("NVIDIA H100 PCIe") == "h100-pcie"
    assert gpu_suite.device_slug("NVIDIA H200") == "h200"
    peak = gpu_suite.nominal_bf16_peak
    assert peak("NVIDIA H100 80GB HBM3") == peak("NVIDIA H200") == 989.4e12
    assert peak("NVIDIA H100 PCIe") == 756e12


def test_flops_rules_on_the_8b_shape():
    """2N forward, 6N full, 4N frozen base under LoRA (+ adapter, + attention): the 8B model has
    8.03B parameters, 7.50B of them multiply (the input embedding is a lookup)."""
    dims = gpu_suite.model_dims(gpu_suite.LLAMA_8B, 8_030_261_248)
    assert dims["matmul_parameters"] == 8_030_261_248 - 128256 * 4096
    assert dims["lora_parameters"] == 41_943_040  # peft's count for r 16 on every linear layer of Llama-3.1-8B
    attention = 4 * 32 * 4096 * 1000.0
    assert gpu_suite.flops_per_token("forward", dims, 1000.0) == 2 * dims["matmul_parameters"] + attention
    assert gpu_suite.flops_per_token("full", dims, 1000.0) == 3 * (2 * dims["matmul_parameters"] + attention)
    assert gpu_suite.flops_per_token("lora", dims, 1000.0) == (4 * dims["matmul_parameters"]
                                                                + 6 * dims["lora_parameters"] + 3 * attention)


def test_tulu_rows_fit_the_maximum_length():
    rows = gpu_suite.tulu_rows(gpu_suite.GPU, 64)
    assert rows[:16] == gpu_suite.tulu_rows(gpu_suite.GPU, 16)  # a shorter set is the longer one's start
    for row in rows:
        prompt, chosen, rejected = (len(row[k].split()) for k in ("prompt", "chosen", "rejected"))
        assert 200 <= prompt <= 1200 and 100 <= min(chosen, rejected) and max(chosen, rejected) <= 800
        assert prompt + max(chosen, rejected) + 1 <= 2048


def test_a_failed_worker_is_named_by_its_own_error_line(tmp_path):
    log = tmp_path / "suite.log"
    log.write_text("\n=== dpo-build {}\nok\n\n=== trl-train {}\nwarnings.warn(FutureWarning)\n"
                   "Traceback (most recent call last):\n  File x\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    assert gpu_suite.last_log_line(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    log.write_text(log.read_text() + "\n=== dpo-train {}\ndpocache train: error: --kernels liger: CUDA only\n")
    assert gpu_suite.last_log_line(log) == "dpocache train: error: --kernels liger: CUDA only"


def test_a_dpocache_only_ab_is_not_merged_with_a_run_against_trl(tmp_path):
    """``--no-trl --train-args``: dpocache's options compared on one machine; such a part and a
    suite run against TRL are different measurements, refused as one result."""
    committed = BENCH / "results" / "gpu-suite-h200-20261126.json"  # written before the options existed
    ab = json.loads(committed.read_text())
    ab.update(train_args=["--compile", "on"], no_trl=True, rows=[])
    (tmp_path / "ab.json").write_text(json.dumps(ab))
    with pytest.raises(ValueError, match="train_args"):
        gpu_suite.merge_parts([committed, tmp_path / "ab.json"])
    ab.update(train_args=[], no_trl=False)  # the defaults: what the committed result ran with
    (tmp_path / "ab.json").write_text(json.dumps(ab))
    assert gpu_suite.merge_parts([committed, tmp_path / "ab.json"])["rows"]


def test_no_trl_runs_no_trl_worker(tmp_path, monkeypatch):
    spawned = []
    monkeypatch.setattr(gpu_suite, "run_worker", lambda mode, *a: spawned.append(mode) or {"mode": mode})
    suite = gpu_suite.Suite(gpu_suite.DRY, tmp_path, tmp_path, tmp_path / "log", [], None, no_trl=True)
    assert gpu_suite.run_side(suite, "row", "trl-train", {}) == (None, None)
    assert gpu_suite.run_side(suite, "row", "dpo-train", {}) == ({"mode": "dpo-train"}, None)
    assert spawned == ["dpo-train"]


def test_build_args_reach_the_ref_8b_build_and_keep_parts_apart(tmp_path, monkeypatch):
    """``--build-args``: more ``cache build`` options in ref-8b's dpocache build (an A/B such as
    ``--stream-reference true``), named in the row's setup; a part run with them is not merged
    with one run without."""
    specs = {}
    monkeypatch.setattr(gpu_suite, "llama_inputs", lambda suite, pairs: (tmp_path, tmp_path, {"parameters": 8}))
    monkeypatch.setattr(gpu_suite, "data_stats", lambda *a: {"mean_seq_len": 10.0, "unique_tokens": 100})
    monkeypatch.setattr(gpu_suite, "run_side", lambda suite, row, mode, spec: specs.update({mode: spec}) or
                        (None, f"{mode}: not run here"))
    args = gpu_suite.parse_args(["--only", "ref-8b", "--build-args", "--stream-reference true", "--kernels", "none"])
    suite = gpu_suite.Suite(gpu_suite.DRY, tmp_path, tmp_path, tmp_path / "log", ["--kernels", args.kernels], None,
                            build_args=tuple(args.build_args.split()))
    row = gpu_suite.row_ref_8b(suite)
    assert specs["dpo-build"]["extra_args"] == ["--kernels", "none", "--stream-reference", "true"]
    assert row["setup"]["dpocache_args"] == ["cache", "build", "--kernels", "none", "--stream-reference", "true"]
    committed = BENCH / "results" / "gpu-suite-h200-20261126.json"
    part = json.loads(committed.read_text())
    part.update(build_args=["--stream-reference", "true"], rows=[])
    (tmp_path / "streamed.json").write_text(json.dumps(part))
    with pytest.raises(ValueError, match="build_args"):
        gpu_suite.merge_parts([committed, tmp_path / "streamed.json"])


@pytest.mark.parametrize("ab", ["", "--compile off", "--skip-unread-products false", "--resident-layers 0",
                                "--stream-base false --resident-layers 0 --turn-layers 0 --checkpoint-keep none",
                                "--resident-layers 6 --turn-layers 8",
                                "--resident-layers 6 --checkpoint-keep down_proj --skip-unread-products false",
                                "--resident-layers 0 --checkpoint-keep o_proj,q_proj", "--turn-layers 9",
                                "--resident-layers 10 --turn-layers 0 --checkpoint-keep none"])
def test_the_gpu_lora_rows_options_and_their_ab_flags_pass_the_configuration_checks(monkeypatch, ab):
    """The LoRA row's dpocache options on a GPU (streamed, resident layers, compiled), alone
    and with each A/B of the GPU sessions' plans
    (docs/benchmarks/gpu-suite-h200-20261126-0556.md, gpu-suite-h200-20261126-1325.md,
    gpu-suite-h200-20261127-1850.md), pass
    every check ``train`` makes of its configuration before a model loads, on a machine that has
    CUDA (stood in here): a GPU call is not spent on a combination refused with one line."""
    import shlex

    import torch

    from dpocache.config import build_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = [*gpu_suite.DPO_LORA_ARGS, *gpu_suite.GPU.lora_train_args, *shlex.split(ab)]
    cfg = build_config(None, ["--model", "m", "--data", "d.jsonl", "--device", "cuda", "--dtype", "bfloat16", *args])
    cfg.validate(required=("model.path", "data.train"))
    streamed = "--stream-base false" not in ab
    assert cfg.model.stream_base is streamed and cfg.model.gradient_checkpointing and cfg.lora.r == 16
    resident = int(ab.split("--resident-layers ")[1].split()[0]) if "--resident-layers" in ab else 4
    assert cfg.model.resident_layers == resident
    assert cfg.model.checkpoint_keep == (ab.split("--checkpoint-keep ")[1].split()[0] if "--checkpoint-keep" in ab
                                         else "attention")
    assert cfg.model.skip_unread_products == ("--skip-unread-products false" not in ab)
    assert cfg.model.compile == ("off" if "--compile off" in ab else "on")


def test_a_worker_past_its_timeout_is_killed_and_its_side_fails_without_ending_the_row(tmp_path, monkeypatch):
    """``--worker-timeout``: a side whose process runs past it is killed, and ``run_side`` returns
    why (the row goes on, its other side kept), well before the worker would have ended."""
    import time

    import bench_vs_trl

    sleeper = tmp_path / "workers.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(bench_vs_trl, "WORKERS", sleeper)
    suite = gpu_suite.Suite(gpu_suite.shapes_of(gpu_suite.parse_args(["--dry-run"])), tmp_path, tmp_path,
                            tmp_path / "suite.log", [], None, worker_timeout=1.0)
    t0 = time.perf_counter()
    result, why = gpu_suite.run_side(suite, "train-8b-lora", "dpo-train", {})
    assert result is None and "dpo-train ran past its 1 s and was killed" in why
    assert time.perf_counter() - t0 < 30
    # without a timeout the same call waits for its worker (here one that ends at once)
    sleeper.write_text("import json, sys\nspec = json.load(open(sys.argv[2]))\n"
                       "json.dump({'ok': 1}, open(spec['out'], 'w'))\n")
    suite.worker_timeout = None
    result, why = gpu_suite.run_side(suite, "train-8b-lora", "dpo-train", {})
    assert why is None and result["ok"] == 1


def test_only_runs_its_rows_in_its_own_order_each_once():
    assert gpu_suite.rows_to_run(None) == list(gpu_suite.ROWS)
    assert gpu_suite.rows_to_run(["train-1b-full", "train-8b-lora", "train-1b-full"]) == ["train-1b-full",
                                                                                          "train-8b-lora"]


def test_session_files_lose_the_machines_paths(tmp_path):
    """``bench/gpu_suite.sh scrub OUT`` (the session's last step) writes the repository, OUT,
    the Python prefix and pytest's temporary folders as placeholders in OUT's text files and
    drops torch's empty DEBUG trace lines; the rest of each line, and JSON files, stay as they
    were."""
    repo = BENCH.parent
    out = tmp_path / "out"
    out.mkdir()
    lines = [f"log {repo}/bench/work/gpu-suite-1.log; result {out}/gpu-suite.json",
             "DEBUG    torch.__trace:utils.py:2126 ",
             f"platform linux -- Python 3 -- {sys.prefix}/bin/python3",
             "tmp_path = PosixPath('/tmp/pytest-of-someone/pytest-12/test_x0')",
             "1 failed, 2 passed in 67.88s", "/usr/lib/python3 and /users/x stay"]
    (out / "gpu-tests.txt").write_text("\n".join(lines) + "\n")
    (out / "gpu-suite.json").write_text(json.dumps({"log": str(out)}))
    done = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), "scrub", str(out)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert (out / "gpu-tests.txt").read_text().splitlines() == [
        "log <repo>/bench/work/gpu-suite-1.log; result <out>/gpu-suite.json",
        "platform linux -- Python 3 -- <venv>/bin/python3",
        "tmp_path = PosixPath('<tmp>/test_x0')",
        "1 failed, 2 passed in 67.88s", "/usr/lib/python3 and /users/x stay"]
    assert json.loads((out / "gpu-suite.json").read_text()) == {"log": str(out)}


def test_the_window_s_copies_are_the_difference_of_its_two_ends():
    """``workers.transfers_between``: a streamed base's copies in the timed window, from
    ``StreamedLayers.transfers`` read at its start and its end; the rate from the window's own
    bytes and time; no compute waits where none were timed (a CPU). The caching allocator's
    counters likewise (none on a CPU)."""
    import workers

    before = {"copies": 10, "waits": 1, "copied_gib": 4.0, "copy_s": 0.1, "stall_s": 0.02, "copy_gib_per_s": 40.0,
              "entries": 12, "idle_entries": 3, "turn_kept": 8}
    after = {"copies": 62, "waits": 1, "copied_gib": 25.0, "copy_s": 0.5, "stall_s": 0.12, "copy_gib_per_s": 50.0,
             "entries": 64, "idle_entries": 40, "turn_kept": 48}
    assert workers.transfers_between(before, after) == {"copies": 52, "waits": 0, "copied_gib": 21.0, "copy_s": 0.4,
                                                        "stall_s": 0.1, "copy_gib_per_s": 52.5, "entries": 52,
                                                        "idle_entries": 37, "turn_kept": 40}
    on_cpu = workers.transfers_between({**before, "stall_s": None, "idle_entries": None},
                                       {**after, "stall_s": None, "idle_entries": None})
    assert on_cpu["stall_s"] is None and on_cpu["idle_entries"] is None and on_cpu["copies"] == 52
    # the caching allocator's calls to CUDA in the window: each counter's growth; none on a CPU
    assert workers.allocator_counts({"device": "cpu"}) is None
    assert workers.counts_between(None, None) is None
    window = workers.counts_between({"alloc_retries": 1, "device_frees": 4}, {"alloc_retries": 3, "device_frees": 4})
    assert window == {"alloc_retries": 2, "device_frees": 0}


def test_a_streamed_rows_description_says_whether_its_copies_hid():
    """A row whose dpocache side streamed its base on a GPU says, under its figures, its copies
    in the timed window and how long the compute waited for them (a row without says nothing),
    and a compiled one its graphs and why it recompiled."""
    row = {"name": "train-8b-lora", "tokens_per_s": 9000.0, "trl_tokens_per_s": 2700.0, "vs_trl": 3.3, "mfu": 0.3,
           "peak_mem_gib": 12.8, "trl_peak_mem_gib": 24.7, "mem_vs_trl": 0.52, "met": {}, "wall_s": 190,
           "raw": {"dpocache": {"window_s": 3.72, "streamed_window": {
               "copies": 260, "waits": 0, "copied_gib": 105.6, "copy_s": 1.95, "stall_s": 0.41,
               "copy_gib_per_s": 54.2, "entries": 260, "idle_entries": 31}}}}
    text = gpu_suite.describe_row(row)
    assert "copies     260 layers, 105.6 GiB in 1.95 s; the compute waited 0.41 s of the window's 3.72 s" in text
    assert "host       the device had run dry at 31 of 260 streamed layer starts" in text
    row["raw"]["dpocache"]["streamed_window"]["turn_kept"] = 40  # --turn-layers: layers a forward started uncopied
    text = gpu_suite.describe_row(row)
    assert "copies     260 layers (40 started without one, kept through a turn), 105.6 GiB" in text
    assert "allocator" not in text  # no allocator record (a CPU), or nothing in it: no line
    row["raw"]["dpocache"]["allocator_window"] = {"alloc_retries": 0, "device_allocs": 0, "device_frees": 0,
                                                  "all_stream_syncs": 0}
    assert "allocator" not in gpu_suite.describe_row(row)
    row["raw"]["dpocache"]["allocator_window"].update(alloc_retries=2, device_allocs=3, device_frees=5)
    assert ("  allocator  2 retries, 3 cudaMalloc, 5 cudaFree, 0 syncs of all streams in the window (each free or "
            "sync waits for the whole device)") in gpu_suite.describe_row(row)
    row["raw"]["dpocache"]["window_s"] = None  # steps timed each alone: no window to set the waits beside
    assert "copies" not in gpu_suite.describe_row(row)
    row["raw"]["dpocache"]["streamed_window"] = None
    assert "copies" not in gpu_suite.describe_row(row)
    # a compiled policy's graphs, and the guards that made it compile more
    reasons = ["forward (x.py:1): GLOBAL_STATE changed: grad_mode", "forward (x.py:1): size mismatch"]
    row["raw"]["dpocache"]["ran"] = {"compiler": {"graphs": 3, "graph_breaks": 0, "graph_break_reasons": [],
                                                  "recompile_reasons": reasons}}
    assert ("  compiler   3 graphs, 0 graph breaks; recompiled for: forward (x.py:1): GLOBAL_STATE changed: "
            "grad_mode; forward (x.py:1): size mismatch") in gpu_suite.describe_row(row)


def test_variants_run_dpocaches_side_again_with_their_options_against_the_rows_trl_run(tmp_path, monkeypatch):
    """``--variants``: a training row queues dpocache's side once per set of options (none where
    its reference values failed to build), and ``variant_run`` runs it with the options after
    the row's own, in an output directory of its own, its figures read against the row's TRL
    run and targets (the workers stubbed: the dry run runs the real ones, whose options take
    effect as ``dpocache_args`` do)."""
    specs = []

    def worker(mode, spec, scratch, log, timeout):
        specs.append((mode, spec))
        if mode == "dpo-build":
            return {"summary": {}}
        tokens = 1000 if "--turn-layers" in spec.get("extra_args", []) else 800
        return {"step_s": [1.0, 0.5, 0.5], "step_tokens": [tokens] * 3, "timed_from": 1, "window_s": 1.0,
                "peak_rss_bytes": 2**30 * (3 if mode == "trl-train" else 2)}

    monkeypatch.setattr(gpu_suite, "run_worker", worker)
    (tmp_path / "log").write_text("=== dpo-build\nRuntimeError: exit 1\n")  # what run_side reads of a failure
    shapes = gpu_suite.shapes_of(gpu_suite.parse_args(["--dry-run"]))
    suite = gpu_suite.Suite(shapes, tmp_path, tmp_path, tmp_path / "log", [], 1e12,
                            variants=(("--turn-layers", "8"), ("--compile", "off")))
    own = ["--checkpoint-keep", "down_proj"]
    prep, trl, dpo, errors = gpu_suite.train_row(suite, "train-8b-lora", tmp_path / "m", tmp_path / "d.jsonl",
                                                 tmp_path / "cache", 3, 1, {}, own)
    assert [options for *_, options in suite.variant_runs] == list(suite.variants) and not any(errors)
    row = gpu_suite.finish_row(suite, "train-8b-lora", dpo, trl, gpu_suite.steady_tokens_per_s(dpo, 1),
                               gpu_suite.steady_tokens_per_s(trl, 1), 1e8, errors, {}, {})
    before = len(specs)
    variants = [gpu_suite.variant_run(suite, row, spec, warmup, options)
                for name, spec, warmup, options in suite.variant_runs]
    ran = specs[before:]
    assert [mode for mode, _ in ran] == ["dpo-train", "dpo-train"]
    assert [spec["extra_args"] for _, spec in ran] == [own + ["--turn-layers", "8"], own + ["--compile", "off"]]
    assert len({spec["workdir"] for _, spec in ran} | {specs[before - 1][1]["workdir"]}) == 3  # each its own
    turned = variants[0]
    assert turned["train_args"] == ["--turn-layers", "8"] and turned["tokens_per_s"] == 2000.0
    assert turned["vs_trl"] == pytest.approx(2000 / 1600) and turned["mfu"] == pytest.approx(2000 * 1e8 / 1e12)
    assert turned["peak_mem_gib"] == 2.0 and turned["mem_vs_trl"] == pytest.approx(2 / 3)
    assert turned["met"] == {"mfu": False, "mem_vs_trl": False} and "error" not in turned
    assert variants[1]["tokens_per_s"] == 1600.0
    # a row whose reference values failed to build queues none
    def build_fails(mode, *args):
        if mode == "dpo-build":
            raise RuntimeError("exit 1")
        return worker(mode, *args)

    monkeypatch.setattr(gpu_suite, "run_worker", build_fails)
    suite.variant_runs.clear()
    *_, errors = gpu_suite.train_row(suite, "train-8b-lora", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "cache",
                                     3, 1, {}, own)
    assert errors[0] and suite.variant_runs == []


def test_a_variants_line_gives_its_options_figures_and_verdicts():
    """``describe_variant``: its options, tokens/s, MFU and peak, each ratio to TRL and target's
    verdict where the row ran TRL (none with ``--no-trl``), or its error; under it, indented, its
    graphs and streamed copies as a row's; the row's description lists its variants under its
    figures."""
    variant = {"name": "train-8b-lora", "train_args": ["--turn-layers", "8"], "tokens_per_s": 10500.0,
               "mfu": 0.36, "vs_trl": 3.8, "peak_mem_gib": 13.1, "mem_vs_trl": 0.53,
               "met": {"mfu": True, "mem_vs_trl": True}}
    assert gpu_suite.describe_variant(variant) == (
        "  variant    --turn-layers 8: 10,500 tokens/s (3.80x TRL), MFU 36.0% ok, peak 13.1 GiB (0.53x TRL ok)")
    alone = {**variant, "vs_trl": None, "mem_vs_trl": None, "mfu": 0.3, "met": {"mfu": False, "mem_vs_trl": None}}
    assert gpu_suite.describe_variant(alone) == ("  variant    --turn-layers 8: 10,500 tokens/s, MFU 30.0% MISS, "
                                                 "peak 13.1 GiB")
    failed = {**variant, "error": "dpo-train: torch.OutOfMemoryError: CUDA out of memory"}
    assert gpu_suite.describe_variant(failed) == (
        "  variant    --turn-layers 8: error: dpo-train: torch.OutOfMemoryError: CUDA out of memory")
    row = {"name": "train-8b-lora", "tokens_per_s": 9000.0, "trl_tokens_per_s": 2700.0, "vs_trl": 3.3, "mfu": 0.3,
           "peak_mem_gib": 12.8, "trl_peak_mem_gib": 24.7, "mem_vs_trl": 0.52, "met": {}, "wall_s": 190,
           "variants": [variant, failed]}
    lines = gpu_suite.describe_row(row).splitlines()
    assert lines[-2:] == [gpu_suite.describe_variant(variant), gpu_suite.describe_variant(failed)]
    # a variant that streamed and compiled on a GPU: its copies, waits, idle starts and graphs under its line
    variant["raw"] = {"window_s": 3.5, "ran": {"compiler": {"graphs": 2, "graph_breaks": 0, "recompile_reasons": []}},
                      "streamed_window": {"copies": 180, "waits": 0, "copied_gib": 73.1, "copy_s": 1.4,
                                          "stall_s": 0.05, "entries": 260, "idle_entries": 3, "turn_kept": 80}}
    assert gpu_suite.describe_variant(variant).splitlines()[1:] == [
        "    compiler   2 graphs, 0 graph breaks",
        "    copies     180 layers (80 started without one, kept through a turn), 73.1 GiB in 1.40 s; the compute "
        "waited 0.05 s of the window's 3.50 s",
        "    host       the device had run dry at 3 of 260 streamed layer starts (there the host set the pace)"]


def test_the_lora_row_runs_dpocaches_default_batch_and_the_others_theirs():
    """On the GPU the LoRA row runs 8 pairs a step (4.5% more tokens a second than 4 on an
    H200), the 1.1B row and TRL's precompute 4; ``--batch-size`` sets them all."""
    shapes = gpu_suite.shapes_of(gpu_suite.parse_args([]))
    assert [gpu_suite.row_batch_size(shapes, row) for row in ("train-8b-lora", "train-1b-full")] == [8, 4]
    assert shapes.batch_size == 4
    shapes = gpu_suite.shapes_of(gpu_suite.parse_args(["--batch-size", "6"]))
    assert [gpu_suite.row_batch_size(shapes, row) for row in ("train-8b-lora", "train-1b-full")] == [6, 6]


def test_check_takes_the_gpus_options_on_a_machine_without_one(capsys, monkeypatch, tmp_path):
    """``--check`` reads the options as ``dpocache train`` would on the GPU, with its shapes, and
    stops: a streamed variant the GPU's LoRA row takes passes here (the dry run, which streams
    nothing, refuses it), a refused one names its row and flag with exit 2; nothing is built
    (no work directory) and the process's view of CUDA is its own again after it."""
    monkeypatch.chdir(tmp_path)
    variants = ["--variants", "--turn-layers 8", "--batch-size 4 --resident-layers 6"]
    assert gpu_suite.main(["--check", "--only", "train-8b-lora", *variants]) == 0
    assert capsys.readouterr().out.strip() == ("gpu_suite: dpocache train takes the options of train-8b-lora and "
                                               "2 variants (the GPU's shapes, batch 4, the LoRA row's 8)")
    assert gpu_suite.main(["--check", "--only", "train-8b-lora", "--batch-size", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith("(the GPU's shapes, batch 2, the LoRA row's 2)")
    assert gpu_suite.main(["--check", "--dry-run", "--only", "train-8b-lora", *variants]) == 2
    assert "with --variants '--turn-layers 8': --turn-layers" in capsys.readouterr().err
    assert gpu_suite.main(["--check", "--only", "train-8b-lora", "--variants", "--resident-layers x"]) == 2
    assert "train-8b-lora with --variants '--resident-layers x': --resident-layers" in capsys.readouterr().err
    assert torch.cuda.is_available.__module__ == "torch.cuda"  # torch's own again, not the check's stand-in
    assert not list(tmp_path.iterdir())


def test_a_variants_leading_dpocache_words_set_its_workers_environment(tmp_path, monkeypatch):
    """``--variants "DPOCACHE_ROW_GROUPS=1 --turn-layers 8"``: the leading ``DPOCACHE_NAME=VALUE``
    words go to the variant's worker's environment (beside the row's own), the rest to ``train``;
    a value dpocache would refuse stops the check, naming the variable."""
    split = gpu_suite.split_variant
    assert split(("DPOCACHE_ROW_GROUPS=1", "--turn-layers", "8")) == ({"DPOCACHE_ROW_GROUPS": "1"},
                                                                       ("--turn-layers", "8"))
    late = ("--turn-layers", "8", "DPOCACHE_ROW_GROUPS=1")  # only leading words set the environment
    assert split(late) == ({}, late)
    assert split(("DPOCACHE_ROW_GROUPS=1",)) == ({"DPOCACHE_ROW_GROUPS": "1"}, ())
    suite = gpu_suite.Suite(gpu_suite.shapes_of(gpu_suite.parse_args(["--dry-run"])), tmp_path, tmp_path,
                            tmp_path / "log", [], None)
    specs = []
    monkeypatch.setattr(gpu_suite, "run_side", lambda suite, row, mode, spec: specs.append(spec) or (None, "no run"))
    row = {"name": "train-8b-lora", "flops_per_token": 1.0}
    spec = {"extra_args": ["--lora-r", "16"], "env": {"HF_HOME": "h"}}
    variant = gpu_suite.variant_run(suite, row, spec, 1, ("DPOCACHE_ROW_GROUPS=1", "--turn-layers", "8"))
    assert specs[0]["env"] == {"HF_HOME": "h", "DPOCACHE_ROW_GROUPS": "1"}
    assert specs[0]["extra_args"] == ["--lora-r", "16", "--turn-layers", "8"]
    assert variant["train_args"] == ["DPOCACHE_ROW_GROUPS=1", "--turn-layers", "8"] and variant["error"] == "no run"
    suite.variants = (("DPOCACHE_ROW_GROUPS=1",), ("DPOCACHE_ROW_GROUPS=7",))
    refused = gpu_suite.refused_train_args(suite, ["train-8b-lora"])
    assert refused.startswith("train-8b-lora with --variants DPOCACHE_ROW_GROUPS=7: $DPOCACHE_ROW_GROUPS must be")


def test_options_dpocache_would_refuse_stop_the_suite_before_any_row(tmp_path, capsys):
    """``--train-args`` that ``dpocache train`` refuses with the row's own options (here
    ``--resident-layers`` without a streamed base) stop the suite with one line naming the row
    and the flag, exit 2, before any model is built or result written."""
    out = tmp_path / "x.json"
    rc = gpu_suite.main(["--dry-run", "--only", "train-1b-full", "--train-args", "--resident-layers 2",
                         "--work", str(tmp_path / "work"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "train-1b-full" in err and "--resident-layers" in err and "--stream-base" in err
    assert not out.exists() and not list((tmp_path / "work").glob("gpu-suite-*"))
    # the same row and suite with options it takes pass the check
    suite = gpu_suite.Suite(gpu_suite.shapes_of(gpu_suite.parse_args(["--dry-run"])), tmp_path, tmp_path,
                            tmp_path / "log", [], None)
    assert gpu_suite.refused_train_args(suite, list(gpu_suite.ROWS)) is None
    # a variant is checked as the row's own options are: the first refused names it
    suite.variants = (("--checkpoint-keep", "none"), ("--resident-layers", "2"))
    refused = gpu_suite.refused_train_args(suite, ["train-8b-lora"])
    assert refused.startswith("train-8b-lora with --variants '--resident-layers 2': --resident-layers")
    # --checkpoint-keep's names against the 8B's config (its shape on the meta device), as train checks them
    suite.variants = (("--checkpoint-keep", "o_proj"), ("--checkpoint-keep", "atention"))
    refused = gpu_suite.refused_train_args(suite, ["train-8b-lora"])
    assert refused.startswith("train-8b-lora with --variants '--checkpoint-keep atention': --checkpoint-keep")
    assert "no linear layer named 'atention'" in refused
    suite.variants = (("--checkpoint-keep", "attention"),)  # the dry run's CPU runs sdpa under auto
    assert "auto runs sdpa on cpu" in gpu_suite.refused_train_args(suite, ["train-8b-lora"])
    suite.variants = (("--checkpoint-keep", "attention", "--attention", "causal"),)
    assert gpu_suite.refused_train_args(suite, ["train-8b-lora"]) is None
