"""One benchmark run per process: ``python bench/workers.py MODE SPEC_JSON``.

Each run is its own process so its peak RSS (read by the parent with ``wait4``) is its own. The
parent passes the wall-clock time at which it spawned the process (``spawned_at``); start-up
times are measured from it, so they include interpreter start and imports.

Modes:
    trl-precompute  TRL DPOTrainer with precompute_ref_log_probs=True: time its precompute
    trl-train       TRL DPOTrainer training steps, its precomputed values read from its cache
    dpo-build       ``dpocache cache build --json``, in process (the CLI's own code path)
    dpo-train       ``dpocache train`` steps on a built cache
    dpo-startup     ``dpocache train`` until its first step, then stop (start-up on a cache hit)
    trl-hash        TRL's state-dict hash alone (what its every start costs beyond loading)
    build-model     a Llama built from a config with random weights, on the spec's device and in
                    its dtype, saved once with ``save_pretrained`` (``bench/gpu_suite.py``'s 8B model)

Optional spec fields, added for ``bench/gpu_suite.py`` (each absent field keeps the behaviour
``bench_vs_trl.py`` measured with):
    trl_model_dtype  the dtype TRL loads the model in (default float32: autocast over fp32
                     weights, as dpocache does); the suite's 8B rows load it in bfloat16
    trl_lora         ``{"r": 16, "alpha": 32}``: TRL trains a LoRA adapter (``peft_config``)
    trl_skip_hash    TRL's state-dict hash not run (it lies outside every timed span; on an 8B
                     model it costs about 20 s a process): the fingerprint it names is constant,
                     so the run needs a fresh ``HF_DATASETS_CACHE``, as the suite gives it
    profile          a file: dpo-build's pass after its model's load, or dpo-train's
                     ``profile_steps`` steps after its timed ones (``steps`` counts them too),
                     run under torch.profiler, its kernel table written there, the host's and the
                     device's time per step (per forward pass of a build) in the result
                     (``common.profile_summary``). A training run profiles in the process it was
                     timed in, its model loaded and its graphs compiled once: its timed figures
                     and peak GPU memory are read before the profiled steps start

Training runs also record ``step_tokens``, the real tokens of each step (each prompt once, plus
chosen and rejected), beside ``step_s``.

Results go to ``SPEC["out"]`` as JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path


def _write(spec: dict, result: dict) -> None:
    """``result`` into ``spec["out"]``, with the GPU's peaks where no earlier reading is in it."""
    result = {**gpu_peaks(spec), **result}
    Path(spec["out"]).write_text(json.dumps(result))


def gpu_peaks(spec: dict) -> dict:
    """The process's whole GPU peak so far (weights, optimizer state, activations, the allocator's
    cache) and the device's name; nothing on a CPU."""
    if spec.get("device", "cpu") == "cpu":
        return {}
    import torch

    return {"peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(), "gpu_name": torch.cuda.get_device_name()}


def _sync(spec: dict) -> None:
    """Wait for the GPU's queued work, so a step's wall time is its own (no-op on CPU)."""
    if spec.get("device", "cpu") != "cpu":
        import torch

        torch.cuda.synchronize()


class StepClock:
    """Times a worker's training steps, ``spec["steps"]`` of them.

    Each step alone (the default): the GPU synchronised before and after every step, so each
    ``step_s`` is that step's own time. With ``spec["timed_from"] = k``, only the window from
    step ``k`` (0-based) to the last is synchronised, at its two ends: the steps run as in a real
    run, the host queueing the next step while the GPU finishes the last, and ``window_s`` is
    the window's wall time (``step_s`` are then the host's intervals between steps). A profiled
    run's last ``profile_steps`` steps are not timed."""

    def __init__(self, spec: dict):
        # the steps it times: a profiled run's steps after them are not (``profile_steps``)
        self.spec, self.total = spec, spec.get("steps", 1) - profile_steps(spec)
        self.timed_from = spec.get("timed_from")
        self.steps: list[float] = []
        self.window_start: float | None = None
        self.window_s: float | None = None
        self.t = 0.0

    def begin(self) -> None:
        index = len(self.steps)
        if self.timed_from is None or index == self.timed_from:
            _sync(self.spec)
        self.t = time.perf_counter()
        if index == self.timed_from:
            self.window_start = self.t

    def end(self) -> None:
        last = len(self.steps) + 1 == self.total
        if self.timed_from is None or last:
            _sync(self.spec)
        now = time.perf_counter()
        self.steps.append(now - self.t)
        if last and self.window_start is not None:
            self.window_s = now - self.window_start

    def record(self) -> dict:
        return {"step_s": self.steps, "timed_from": self.timed_from, "window_s": self.window_s}


def _token_counts(dataset) -> dict:
    p = sum(len(x) for x in dataset["prompt_ids"])
    c = sum(len(x) for x in dataset["chosen_ids"])
    r = sum(len(x) for x in dataset["rejected_ids"])
    return {"prompt": p, "chosen": c, "rejected": r, "unique": p + c + r, "prompt_twice": 2 * p + c + r}


def _batch_unique_tokens(inputs: dict) -> int:
    """Real tokens of one TRL training batch, each prompt once: its collator stacks the B
    prompt+chosen rows over the B prompt+rejected rows, so the chosen half's attention mask plus
    the rejected half's completion mask."""
    half = inputs["input_ids"].shape[0] // 2
    return int(inputs["attention_mask"][:half].sum() + inputs["completion_mask"][half:].sum())


# ----------------------------------------------------------------------------------- TRL


def _trl_trainer(spec: dict, callbacks=()):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    import trl.trainer.dpo_trainer as dpo_mod

    timings: dict = {}
    t = time.perf_counter()
    model_dtype = getattr(torch, spec.get("trl_model_dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=model_dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    timings["model_load_s"] = time.perf_counter() - t
    dataset = load_dataset("json", data_files=spec["data"], split="train")

    original_hash = dpo_mod.hash_module

    def timed_hash(module):
        if spec.get("trl_skip_hash"):
            timings["hash_module_skipped"] = True
            return "not-hashed"  # names the precompute's file in a fresh HF_DATASETS_CACHE only
        t = time.perf_counter()
        out = original_hash(module)
        timings["hash_module_s"] = time.perf_counter() - t
        return out

    dpo_mod.hash_module = timed_hash
    original_precompute = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, dataset, name, batch_size):
        t = time.perf_counter()
        saved = spec.get("trl_ref_values")
        if saved and Path(saved).exists():
            # TRL's own values from the precompute run, read back as its cache hit would
            # (its datasets cache did not hit across processes in our runs: see bench/README.md).
            values = json.loads(Path(saved).read_text())
            out = (dataset.add_column("ref_chosen_logps", values["chosen"])
                   .add_column("ref_rejected_logps", values["rejected"]))
            timings["precompute_injected_s"] = time.perf_counter() - t
            return out
        out = original_precompute(self, dataset, name, batch_size)
        timings["precompute_s"] = time.perf_counter() - t
        timings["precompute_batch_size"] = batch_size
        if saved:
            Path(saved).write_text(json.dumps({"chosen": list(out["ref_chosen_logps"]),
                                               "rejected": list(out["ref_rejected_logps"])}))
        return out

    DPOTrainer._precompute_ref_logps = timed_precompute
    bf16 = spec["dtype"] == "bfloat16"
    args = DPOConfig(
        output_dir=spec["workdir"], per_device_train_batch_size=spec["batch_size"], precompute_ref_log_probs=True,
        precompute_ref_batch_size=spec.get("trl_precompute_batch_size"), bf16=bf16, fp16=False,
        use_cpu=spec.get("device", "cpu") == "cpu", max_length=None,  # no truncation, as dpocache's --max-length none
        report_to="none", gradient_checkpointing=spec.get("trl_gradient_checkpointing", False),
        max_steps=spec.get("steps", 1), save_strategy="no", logging_steps=10_000, disable_tqdm=True,
        dataloader_num_workers=0, seed=0, learning_rate=1e-6, warmup_steps=0, beta=0.1,
    )
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=list(callbacks), peft_config=_trl_peft_config(spec))
    return trainer, timings


def _trl_peft_config(spec: dict):
    """The LoRA adapter TRL trains when the spec asks for one (all linear layers, as dpocache's
    ``--lora.target_modules`` default), else None (every weight trained)."""
    lora = spec.get("trl_lora")
    if not lora:
        return None
    import peft

    return peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules="all-linear", task_type="CAUSAL_LM")


def trl_precompute(spec: dict) -> None:
    trainer, timings = _trl_trainer(spec)
    counts = _token_counts(trainer.train_dataset)
    _write(spec, {"side": "trl", **timings, "tokens": counts,
                  "tokens_per_s": counts["unique"] / timings["precompute_s"],
                  "tokens_per_s_prompt_twice": counts["prompt_twice"] / timings["precompute_s"]})


def trl_train(spec: dict) -> None:
    from transformers import TrainerCallback

    clock = StepClock(spec)
    marks: dict = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.setdefault("first_step_at", time.time())
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.end()

    trainer, timings = _trl_trainer(spec, callbacks=[Timer()])
    if "precompute_s" in timings:
        timings["cache_missed"] = True  # TRL recomputed: its datasets cache was not hit
    step_tokens: list[int] = []
    original_training_step = trainer.training_step

    def counted_step(model, inputs, *a, **kw):
        step_tokens.append(_batch_unique_tokens(inputs))
        return original_training_step(model, inputs, *a, **kw)

    trainer.training_step = counted_step  # one call per step (no gradient accumulation here)
    trainer.train()
    _write(spec, {"side": "trl", **timings, **clock.record(), "step_tokens": step_tokens,
                  "tokens": _token_counts(trainer.train_dataset),
                  "startup_s": marks["first_step_at"] - spec["spawned_at"],
                  "startup_beyond_load_s": marks["first_step_at"] - spec["spawned_at"] - timings["model_load_s"]})


# ------------------------------------------------------------------------------ dpocache


def dpo_build(spec: dict) -> None:
    from dpocache.cli import entry as cli
    from dpocache.models.reference import ReferenceModel

    loads: list[float] = []
    original = ReferenceModel.from_pretrained.__func__
    profiler = _profiler(spec)

    def timed(cls, *a, **kw):
        t = time.perf_counter()
        out = original(cls, *a, **kw)
        loads.append(time.perf_counter() - t)
        if profiler is not None and len(loads) == 1:  # the pass, from its model's load on
            profiler.__enter__()
        return out

    ReferenceModel.from_pretrained = classmethod(timed)
    argv = ["cache", "build", "--model", spec["model"], "--data", spec["data"], "--dtype", spec["dtype"],
            "--device", spec.get("device", "cpu"), "--cache-dir", spec["cache_dir"], "--json",
            "--max-length", "none",  # as training's
            *spec.get("extra_args", [])]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    if profiler is not None and loads:
        profiler.__exit__(None, None, None)
    if rc != 0:
        raise SystemExit(f"dpocache cache build failed ({rc}): {buf.getvalue()}")
    summary = json.loads(buf.getvalue().strip().splitlines()[-1])
    load = sum(loads)
    compute = summary["seconds"] - load
    _write(spec, {"side": "dpocache", "summary": summary, "model_load_s": load, "compute_s": compute,
                  "tokens": summary["tokens"], "tokens_per_s": summary["tokens"] / compute if compute > 0 else 0.0,
                  "wall_s": time.time() - spec["spawned_at"],
                  **_write_profile(spec, profiler if loads else None, summary.get("forward_passes") or 1)})


class _Stop(Exception):
    pass


def _dpo_train(spec: dict, stop_at_first_step: bool) -> dict:
    import dpocache.training.loop as train_mod
    import dpocache.training.setup as setup_mod  # setup() loads the policy: its load_policy is timed
    from dpocache.training import prefetch
    from dpocache.config import build_config

    # Python-level imports (torch, transformers' lazily imported model and tokenizer modules),
    # timed apart: every PyTorch trainer pays them, whatever it does after. peft is imported
    # only by runs with LoRA (it adds about 3 s), so not here.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    AutoConfig.from_pretrained(spec["model"])  # imports the architecture's modules
    imports_done = time.time()

    marks: dict = {"load_s": 0.0}
    clock = StepClock(spec)
    step_tokens: list[int] = []
    original_step, original_load = train_mod.train_step, setup_mod.load_policy

    def timed_load(*a, **kw):
        t = time.perf_counter()
        out = original_load(*a, **kw)
        marks["load_s"] += time.perf_counter() - t
        return out

    profiler, profiled = _profiler(spec), []  # the profiled steps' tokens

    def timed_step(run, window):
        marks.setdefault("first_step_at", time.time())
        if stop_at_first_step:
            raise _Stop
        tokens = sum(run.train_data.pairs[i].unique_tokens for micro in range(run.cfg.train.grad_accum)
                     for i in prefetch.step_indices(run, run.step, micro))
        if len(clock.steps) == clock.total:  # past the timed steps: the profiled ones
            profiled_step(run, window, tokens)
            return
        step_tokens.append(tokens)
        marks.setdefault("reference", {k: run.info.get("reference", {}).get(k) for k in ("computed", "reused")})
        streamed = getattr(run.policy, "dpocache_streamed", None)
        if len(step_tokens) - 1 == spec.get("timed_from", 0):
            if streamed is not None:
                marks["transfers_before"] = streamed.transfers.to_json()  # waits for the device, as the clock does
            marks["allocator_before"] = allocator_counts(spec)
        clock.begin()
        original_step(run, window)
        clock.end()
        if len(clock.steps) == clock.total:
            if "transfers_before" in marks:
                marks["streamed_window"] = transfers_between(marks["transfers_before"], streamed.transfers.to_json())
            marks["allocator_window"] = counts_between(marks.get("allocator_before"), allocator_counts(spec))
            marks["peaks"] = gpu_peaks(spec)  # the timed run's: the profiled steps leave it alone

    def profiled_step(run, window, tokens):
        """One of the steps after the timed ones, under the profiler (started at the first, the
        device synchronised, stopped after the last)."""
        if not profiled:
            profiler.__enter__()
        original_step(run, window)
        profiled.append(tokens)
        if len(profiled) == profile_steps(spec):
            _sync(spec)
            profiler.__exit__(None, None, None)

    train_mod.train_step, setup_mod.load_policy = timed_step, timed_load
    from common import timed_train_args

    overrides = timed_train_args(spec["model"], spec["data"], spec["dtype"], spec.get("device", "cpu"),
                                 spec["cache_dir"], spec["workdir"], spec["batch_size"], spec.get("steps", 1))
    cfg = build_config(None, [*overrides, *spec.get("extra_args", [])])
    try:
        train_mod.train(cfg)
    except _Stop:
        pass
    first = marks["first_step_at"]
    profile = _write_profile(spec, profiler, len(profiled)) if len(profiled) == profile_steps(spec) else {}
    return {"side": "dpocache", "model_load_s": marks["load_s"], **clock.record(), **marks.get("peaks", {}),
            **profile, "profiled_tokens": profiled or None,
            "step_tokens": step_tokens, "streamed_window": marks.get("streamed_window"),
            "allocator_window": marks.get("allocator_window"),
            "reference_pairs": marks.get("reference"), "ran": _what_ran(Path(spec["workdir"]) / "run.json"),
            "imports_s": imports_done - spec["spawned_at"],
            "startup_beyond_load_and_imports_s": first - imports_done - marks["load_s"],
            "startup_s": first - spec["spawned_at"],
            "startup_beyond_load_s": first - spec["spawned_at"] - marks["load_s"]}


def transfers_between(before: dict, after: dict) -> dict:
    """A streamed base's copies in the timed window (``StreamedLayers.transfers`` read at its two
    ends): how many, their bytes and time, how long the compute stood waiting for them, and at
    how many layer starts the device had run dry (None on a CPU): beside ``window_s``, whether
    the copies hide behind the steps' compute, and whether the host sets the pace."""
    def diff(key: str, digits: int):
        return None if after[key] is None else round(after[key] - before[key], digits)

    copied_gib, copy_s = diff("copied_gib", 3), diff("copy_s", 6)
    return {"copies": after["copies"] - before["copies"], "waits": after["waits"] - before["waits"],
            "copied_gib": copied_gib, "copy_s": copy_s, "stall_s": diff("stall_s", 6),
            "copy_gib_per_s": round(copied_gib / copy_s, 2) if copy_s else None,
            "entries": after["entries"] - before["entries"], "idle_entries": diff("idle_entries", 0),
            "turn_kept": after.get("turn_kept", 0) - before.get("turn_kept", 0)}


# torch.cuda.memory_stats' counters of the caching allocator's own calls to CUDA: a retry frees its
# cached blocks (cudaFree) and allocates again; cudaFree and a sync of all streams wait for the
# whole device, so a copy stream's work cannot overlap them.
ALLOCATOR_COUNTS = {"alloc_retries": "num_alloc_retries", "device_allocs": "num_device_alloc",
                    "device_frees": "num_device_free", "all_stream_syncs": "num_sync_all_streams"}


def allocator_counts(spec: dict) -> dict | None:
    """The caching allocator's counters now (``ALLOCATOR_COUNTS``); None on a CPU."""
    if spec.get("device", "cpu") == "cpu":
        return None
    import torch

    stats = torch.cuda.memory_stats()
    return {name: stats.get(key, 0) for name, key in ALLOCATOR_COUNTS.items()}


def counts_between(before: dict | None, after: dict | None) -> dict | None:
    """What the allocator did in the timed window: each counter's growth (None on a CPU)."""
    if before is None or after is None:
        return None
    return {name: after[name] - before[name] for name in after}


def profile_steps(spec: dict) -> int:
    """How many of a training run's steps (``spec["steps"]``) follow its timed ones under the
    profiler: ``spec["profile_steps"]`` where it profiles (``spec["profile"]``), else none."""
    return spec.get("profile_steps", 0) if spec.get("profile") else 0


def _profiler(spec: dict):
    """torch.profiler over the CPU (and CUDA) for ``spec["profile"]``; None without it."""
    if not spec.get("profile"):
        return None
    from torch.profiler import ProfilerActivity, profile

    on_cuda = spec.get("device", "cpu") != "cpu"
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else []))


def _write_profile(spec: dict, profiler, steps: int) -> dict:
    """The profiled steps' kernel table into ``spec["profile"]``; their per-step summary."""
    if profiler is None or steps < 1:
        return {}
    from common import profile_summary

    on_cuda = spec.get("device", "cpu") != "cpu"
    averages = profiler.key_averages()
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    Path(spec["profile"]).write_text(averages.table(sort_by=key, row_limit=50, max_name_column_width=70))
    return {"profiled_steps": steps, **profile_summary(averages, steps, on_cuda)}


def _what_ran(run_json: Path) -> dict | None:
    """What the run's ``run.json`` says ran: the policy's layout, compiled layers (and the graphs
    and graph breaks compiling them took), kernels, prefetch, streamed base and kept products (a
    report names them beside its figures); None before the run wrote it."""
    if not run_json.is_file():
        return None
    info = json.loads(run_json.read_text())
    policy = info.get("policy", {})
    return {"layout": info.get("layout"), "dtype": info.get("dtype"),
            **{k: policy.get(k) for k in ("compiled_layers", "kernels", "prefetch", "trainable", "parameters",
                                          "streamed", "kept_products", "skipped_products", "compiler")}}


def dpo_train(spec: dict) -> None:
    _write(spec, _dpo_train(spec, stop_at_first_step=False))


def dpo_startup(spec: dict) -> None:
    _write(spec, _dpo_train(spec, stop_at_first_step=True))


def trl_hash(spec: dict) -> None:
    """What TRL's DPOTrainer does to the model on every start with precompute_ref_log_probs:
    hash its whole state dict (trl.trainer.utils.hash_module)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import hash_module

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    load = time.perf_counter() - t
    t = time.perf_counter()
    hash_module(model)
    _write(spec, {"side": "trl", "model_load_s": load, "hash_module_s": time.perf_counter() - t})


def build_model(spec: dict) -> None:
    """A Llama of ``spec["llama"]``'s shape (LlamaConfig keywords) with random weights, created
    directly on ``spec["device"]`` in ``spec["dtype"]`` (transformers' own initialisation: normal,
    std 0.02; an 8B model's eight billion draws are the GPU's work, not the CPU's), saved with
    ``save_pretrained`` (safetensors) beside the benchmarks' tokenizer into ``spec["model_dir"]``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(spec["tokenizer_vocab"])
    config = LlamaConfig(**spec["llama"], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(spec.get("seed", 0))
    t = time.perf_counter()
    with torch.device(spec["device"]):
        model = LlamaForCausalLM._from_config(config, dtype=getattr(torch, spec["dtype"]))
    _sync(spec)
    init_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    model.save_pretrained(spec["model_dir"])
    tokenizer.save_pretrained(spec["model_dir"])
    _write(spec, {"parameters": n_params, "init_s": init_s, "save_s": time.perf_counter() - t,
                  "tokenizer_vocab": len(tokenizer)})


MODES = {"trl-hash": trl_hash, "trl-precompute": trl_precompute, "trl-train": trl_train, "dpo-build": dpo_build,
         "dpo-train": dpo_train, "dpo-startup": dpo_startup, "build-model": build_model}

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    mode, spec_json = sys.argv[1], sys.argv[2]
    MODES[mode](json.loads(Path(spec_json).read_text()))
