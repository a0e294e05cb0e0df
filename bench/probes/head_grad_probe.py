"""The training head alone: the policy's chunked, checkpointed log-probs under autograd, as
``CompletionLogProbs.head_logps`` computes them now (one ``log_softmax`` of each chunk's logits,
upcast inside it) and as it did before (the logits cast to fp32, then a gather and torch's
``logsumexp``), side by side.

    python bench/probes/head_grad_probe.py [--rows 2048] [--hidden 4096] [--vocab 128256] [--rounds 6] \
        [--dtype bfloat16] [--device cpu] [--out result.json]

A frozen ``(vocab, hidden)`` head (a LoRA policy's, Llama 3's vocabulary by default) over
``--rows`` scored positions, in chunks of ``DEFAULT_LOGITS_BUDGET`` logits, each checkpointed (its
logits recomputed in the backward); the hidden states take the gradient. The two variants run in
turn within each round (the first not timed): forward and backward, synchronised on a GPU.
Prints and writes one JSON object: each variant's median seconds and its rounds, their ratio,
and how far apart their log-probs and gradients are. On a GPU the head's element-wise passes
over its fp32 logits are memory-bound; on a CPU they compete with the head's GEMMs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # dpocache in a checkout not installed

import dpocache.scoring.logprobs as logprobs  # noqa: E402


def before(self, head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The chunk's log-probs under autograd as ``_chunk_logps`` computed them before."""
    logits = self._transform(head(h)).float()  # (C, V)
    return logits.gather(-1, y[:, None]).squeeze(-1) - logits.logsumexp(-1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    head = nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype).requires_grad_(False)
    model = nn.Module()
    model.config = type("Config", (), {"vocab_size": args.vocab, "get_text_config": lambda self: self})()
    model.get_output_embeddings = lambda: head
    scorer = logprobs.CompletionLogProbs(model, probe=False)
    hidden = torch.randn(args.rows, args.hidden, device=device, dtype=dtype)
    labels = torch.randint(0, args.vocab, (args.rows,), device=device)
    weights = torch.randn(args.rows, device=device)
    now = logprobs.CompletionLogProbs._chunk_logps

    def run(variant: str):
        logprobs.CompletionLogProbs._chunk_logps = now if variant == "log_softmax" else before
        h = hidden.clone().requires_grad_(True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = scorer.head_logps(h, labels)
        (out * weights).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out.detach(), h.grad

    variants = ("log_softmax", "logsumexp")
    times: dict[str, list[float]] = {v: [] for v in variants}
    results = {}
    for round_ in range(args.rounds):
        for variant in variants:
            seconds, out, grad = run(variant)
            results[variant] = (out, grad)
            if round_:
                times[variant].append(seconds)
    logprobs.CompletionLogProbs._chunk_logps = now
    median = {v: statistics.median(ts) for v, ts in times.items()}
    (out_a, grad_a), (out_b, grad_b) = results["log_softmax"], results["logsumexp"]
    report = {
        "command": "python bench/probes/head_grad_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype,
        "chunk_rows": max(1, logprobs.DEFAULT_LOGITS_BUDGET // args.vocab),
        "median_s": median, "rounds_s": times,
        "logsumexp_over_log_softmax": median["logsumexp"] / median["log_softmax"],
        "max_logp_diff": float((out_a - out_b).abs().max()),
        "max_grad_diff_over_max_grad": float((grad_a.float() - grad_b.float()).abs().max()
                                             / grad_b.float().abs().max()),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
