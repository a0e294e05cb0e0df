"""Metric reduction, the JSONL writer and its trackers (TensorBoard, W&B), FLOPs and MFU."""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from dpocache.cache.atomic import atomic_write_text
from dpocache.config import ConfigError
from dpocache.distributed.process_group import DistEnv, all_reduce_sum
from dpocache.runtime.preflight import UsageError
from dpocache.scoring import bf16_matmul


class MetricWindow:
    """Sums of per-example metrics over a logging window, reduced across ranks on read.

    Everything is stored as (sum, weight) so that a mean over several micro-batches, steps and
    ranks is the mean over all their examples (or tokens, for token-weighted metrics), not a
    mean of means.

    A sum given as a tensor stays one, on its device, accumulated in float64 (as a Python float
    would be): adding never waits for the device. ``reduce`` synchronises once per window: one
    stacked ``(K, 2)`` tensor, one all-reduce, one ``tolist``.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.weights: dict[str, float] = defaultdict(float)
        self.totals: set[str] = set()  # names reported as sums (token counts), not means

    def add(self, name: str, total: torch.Tensor | float, weight: float) -> None:
        """Add ``total`` (a Python number, or a scalar tensor: kept on its device) of ``weight``
        examples."""
        if isinstance(total, torch.Tensor):
            total = total.detach().to(torch.float64)
        self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.weights[name] += weight

    def set(self, name: str, value: float) -> None:
        """``value`` as of the window's last step (a learning rate: the rate the last step trained
        at, as Hugging Face's Trainer logs the current one), not its mean over the window. Every
        rank sets the same value; the reduction's mean over ranks keeps it."""
        self.sums[name] = float(value)
        self.weights[name] = 1.0

    def add_total(self, name: str, value: float) -> None:
        self.totals.add(name)
        self.add(name, value, 1.0)

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        """Add a ``(B,)`` tensor of per-example values (their fp32 sum, on the device)."""
        self.add(name, values.detach().float().sum(), values.numel())

    def reduce(self, env: DistEnv) -> dict[str, float]:
        names = sorted(self.sums)
        if not names:
            return {}
        sums = torch.stack([torch.as_tensor(self.sums[n], dtype=torch.float64).to(env.device) for n in names])
        weights = torch.tensor([self.weights[n] for n in names], dtype=torch.float64).to(env.device)
        packed = all_reduce_sum(env, torch.stack([sums, weights], 1))  # (K, 2)
        return {n: (s if n in self.totals else s / w if w else float("nan"))
                for n, (s, w) in zip(names, packed.tolist())}  # the window's one synchronisation

    def clear(self) -> None:
        self.sums.clear()
        self.weights.clear()
        self.totals.clear()


# tracker -> (the module it needs, the dpocache extra that installs it)
TRACKER_LIBRARIES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def trackers(report_to: str = "none", tensorboard: bool = False) -> tuple[str, ...]:
    """The trackers asked for: ``report_to``'s names (comma-separated; ``none`` for none), plus
    TensorBoard for the older ``train.tensorboard`` switch."""
    names = [n.strip() for n in report_to.split(",") if n.strip() not in ("", "none")]
    if tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return tuple(dict.fromkeys(names))


def import_tracker(name: str):
    """The library of tracker ``name``, imported only now (both are optional extras); a missing
    one is a ``ConfigError`` of one line, raised before any work when ``setup`` calls this."""
    module, extra = TRACKER_LIBRARIES[name]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--report-to {name}: the '{module}' library is not installed "
                          f"(pip install 'dpocache[{extra}]')") from None


# The W&B run id of a training run, beside its outputs: a resumed run continues that W&B run.
WANDB_RUN_ID_FILE = "wandb-run-id"


class MetricsWriter:
    """``metrics.jsonl`` (one object per line), and the numbers of each row to the trackers asked
    for: TensorBoard events under ``output_dir/tensorboard``, a W&B run (``WANDB_MODE=offline``
    writes it under ``output_dir/wandb`` with no network; ``WANDB_PROJECT`` names the project).

    ``resume``: a run continued from its checkpoint (``--resume``) logs into the W&B run of the
    first attempt (its id kept in ``WANDB_RUN_ID_FILE``), unless ``WANDB_RUN_ID`` says which. W&B
    drops the rows of steps it already has, which the exact resume logs again with the same values."""

    def __init__(self, output_dir: Path, tensorboard: bool = False, enabled: bool = True, report_to: str = "none",
                 config: dict | None = None, resume: bool = False):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        names = trackers(report_to, tensorboard) if enabled else ()
        if "tensorboard" in names:
            import_tracker("tensorboard")
            self._tb = _tensorboard_writer(output_dir / "tensorboard")
        if "wandb" in names:
            wandb = import_tracker("wandb")
            id_file = output_dir / WANDB_RUN_ID_FILE
            same_run = {}
            if resume and id_file.is_file() and not os.environ.get("WANDB_RUN_ID"):
                same_run = {"id": id_file.read_text(encoding="utf-8").strip(), "resume": "allow"}
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "dpocache"), name=output_dir.name,
                                     dir=str(output_dir), config=config, **same_run)
            atomic_write_text(id_file, f"{self._wandb.id}\n")

    def rewind(self, step: int) -> None:
        """Drop the rows a run resumed at ``step`` logs again, so the history has each once:
        rows after ``step``; at step 0 (no checkpoint) every row, the step-0 eval included.
        The rows at a checkpoint's own step were all logged before it was saved, and stay. A
        torn last line (the process was killed while writing it) goes too."""
        if self._tb is not None:
            # The dropped rows are in the earlier attempt's event files too, and TensorBoard would
            # draw them beside the new ones: a writer opened with ``purge_step`` hides, for
            # TensorBoard, every earlier event from that step on.
            log_dir = self._tb.log_dir
            self._tb.close()
            self._tb = _tensorboard_writer(log_dir, purge_step=step + 1 if step > 0 else 0)
        if not self.enabled or not self.path.exists():
            return
        kept = [row for row in _parse(self.path) if step > 0 and row.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(row) + "\n" for row in kept))

    def last_row(self, step: int, prefix: str) -> dict | None:
        """The newest row logged at ``step`` with a metric named ``prefix...`` (None: none)."""
        if not self.enabled or not self.path.exists():
            return None
        rows = [r for r in _parse(self.path) if r.get("step") == step and any(k.startswith(prefix) for k in r)]
        return rows[-1] if rows else None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, record["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _tensorboard_writer(log_dir: str | Path, purge_step: int | None = None):
    from torch.utils.tensorboard import SummaryWriter  # deferred: the tensorboard extra (pyproject's ruff notes)

    return SummaryWriter(str(log_dir), purge_step=purge_step)


def read_metrics(output_dir: str | Path) -> list[dict]:
    return _parse(Path(output_dir) / "metrics.jsonl")


def _parse(path: Path) -> list[dict]:
    """The rows of a metrics file. Its last line may be torn (a kill mid-write): it is
    dropped; a bad line before it is damage, named with its line number."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # a ValueError, which the command line took for a bug: a traceback
        line = data.count(b"\n", 0, e.start) + 1
        raise UsageError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for n, (i, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                break
            raise UsageError(f"{path}:{i}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{i}: not a JSON object (a {type(row).__name__})")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- FLOPs and MFU


def count_params(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def forward_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: float) -> float:
    """Forward FLOPs per token: 2N for the matmuls with the weights plus 4·L·H·T for the
    attention scores and values (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B).
    Embedding lookups are not matmuls, but N includes them: a small overestimate for big
    models, which is the convention MFU figures use."""
    return 2.0 * n_params + 4.0 * n_layers * hidden * seq_len


def train_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: float) -> float:
    """Forward + backward: three times the forward (6N + 12·L·H·T)."""
    return 3.0 * forward_flops_per_token(n_params, n_layers, hidden, seq_len)


def model_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(layers, hidden) from a transformers config."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    return int(layers), int(hidden)


_PEAK_CACHE: dict[tuple[str, str, int], float] = {}


def measured_peak_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 0.5,
                        cached: bool = True) -> float:
    """The machine's matmul throughput (FLOP/s) for ``dtype``, measured: the best of repeated
    square products. MFU is reported against this, not a datasheet figure.

    On a CPU whose bf16 linear layers run through the fp32 GEMM (``dpocache.scoring.bf16_matmul``) the
    fp32 GEMM is what the model's products execute, so that is the peak measured. The matrices
    grow from 256 rows to ``size`` only while one product takes under 50 ms: on a CPU without
    fast bf16 kernels (an AVX2-only EPYC) one 2048 x 2048 bf16 product took about a minute
    (docs/benchmarks/vs-trl-cpu-avx2-2core-20261123.md), and this measurement must never cost
    more than a fraction of a second. A process measures
    once per device, dtype and size unless ``cached`` is False (a benchmark following the machine's drift)."""
    if device.type == "cpu" and dtype == torch.bfloat16 and bf16_matmul.resolve_mode() == "fp32-gemm":
        dtype = torch.float32
    key = (str(device), str(dtype), size)  # a caller may take the best of several sizes
    if cached and key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    n = min(256, size)
    # A generator of its own: drawing from the global one would shift a training run's dropout
    # masks by when its first log happened (a resumed run's came at another step).
    gen = torch.Generator(device=device).manual_seed(0)
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        torch.mm(a, b)  # warm-up: library initialisation, AMX tile configuration
        one = _time_mm(a, b)
        if n >= size or one > 0.05:
            break
        n = min(2 * n, size)
    best = one
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        best = min(best, _time_mm(a, b))
    _PEAK_CACHE[key] = 2.0 * n**3 / best
    return _PEAK_CACHE[key]


def _time_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    _sync(a.device)
    t0 = time.perf_counter()
    torch.mm(a, b)
    _sync(a.device)
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
