"""``dpocache plot OUTPUT``: loss, reward accuracy, reward margins and the chosen and rejected
log-probs, train and eval side by side in each panel (and the SFT term and WPO weights where
the loss logs them), to a PNG."""

from __future__ import annotations

from pathlib import Path

from dpocache.runtime.preflight import UsageError, check_output
from dpocache.training.metrics import read_metrics

# (panel title, metric keys drawn together in it)
PANELS = (("loss", ("loss",)), ("reward accuracy", ("rewards/accuracies",)), ("reward margin", ("rewards/margins",)),
          ("log-probs of chosen and rejected", ("logps/chosen", "logps/rejected")))
# Drawn only where the run logged them (a loss with an SFT term, WPO's weighting).
OPTIONAL_PANELS = (("SFT term (chosen NLL per token)", ("sft_loss",)), ("WPO weights", ("wpo/weights",)))


def panel_series(records: list[dict]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """``{panel title: {series label: (steps, values)}}`` of a run's metric rows: for every key of
    a panel, a train series and an eval series (``eval/`` rows), where the run logged them. The
    ``PANELS`` always; the ``OPTIONAL_PANELS`` where they have a series."""
    panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for title, keys in PANELS + OPTIONAL_PANELS:
        series = panels.setdefault(title, {})
        for key in keys:
            side = f" {key.rsplit('/', 1)[-1]}" if len(keys) > 1 else ""  # "chosen", "rejected"
            for prefix, name in (("", "train"), ("eval/", "eval")):
                points = [(r["step"], r[prefix + key]) for r in records if prefix + key in r]
                if points:
                    steps, values = zip(*points)
                    series[name + side] = (list(steps), list(values))
    optional = {title for title, _ in OPTIONAL_PANELS}
    return {title: series for title, series in panels.items() if series or title not in optional}


def plot_run(output_dir: str | Path, out_file: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    metrics = Path(output_dir) / "metrics.jsonl"
    out_file = Path(out_file) if out_file else Path(output_dir) / "curves.png"
    # The user's mistakes before anything is drawn (each was a traceback, or for a directory
    # --out a file written beside it under another name).
    if not Path(output_dir).is_dir():
        raise UsageError(f"OUTPUT_DIR {output_dir}: no such directory (a training run's --output-dir)")
    if metrics.exists() and not metrics.is_file():
        raise UsageError(f"{metrics}: not a file (OUTPUT_DIR is a training run's output directory)")
    if not metrics.exists():
        raise UsageError(f"OUTPUT_DIR {output_dir}: no metrics.jsonl in it (a training run's --output-dir, once it "
                         "has logged a step)")
    check_output(out_file, "--out", {"OUTPUT_DIR's metrics.jsonl": metrics})
    if not out_file.parent.is_dir():
        raise UsageError(f"--out {out_file}: no directory {out_file.parent} to write it in")
    kind = out_file.suffix[1:].lower()
    if kind and kind not in FigureCanvasBase.get_supported_filetypes():
        raise UsageError(f"--out {out_file}: matplotlib cannot write .{kind} files; name a .png, .pdf or .svg file")
    records = read_metrics(output_dir)
    if not records:
        raise UsageError(f"OUTPUT_DIR {output_dir}: its metrics.jsonl has no rows yet; nothing to draw")
    panels = panel_series(records)
    cols = 2 if len(panels) <= 4 else 3
    fig, axes = plt.subplots(2, cols, figsize=(5 * cols, 7))
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)  # a grid of 5 panels leaves one
    for ax, (title, series) in zip(axes.flat, panels.items()):
        for label, (steps, values) in series.items():
            # a line of one point draws nothing: a short run's training series gets its marker
            style = "o--" if label.startswith("eval") else "-" if len(steps) > 1 else "o"
            ax.plot(steps, values, style, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if series:
            ax.legend()
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return out_file
