"""``dpocache plot OUTPUT``: loss, reward accuracy, reward margins (train and eval) to a PNG."""

from __future__ import annotations

from pathlib import Path

from .metrics import read_metrics

PANELS = (("loss", "loss"), ("rewards/accuracies", "reward accuracy"), ("rewards/margins", "reward margin"),
          ("logps/chosen", "log-prob of chosen"))


def plot_run(output_dir: str | Path, out_file: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    records = read_metrics(output_dir)
    out_file = Path(out_file) if out_file else Path(output_dir) / "curves.png"
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for prefix, style in (("", "-"), ("eval/", "o--")):
            points = [(r["step"], r[prefix + key]) for r in records if prefix + key in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, label="eval" if prefix else "train")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return out_file
