"""What a streamed model's host memory holds while its layers are packed (``--stream-reference``,
``--stream-base``: ``dpocache.models.streaming``), read from ``/proc/self/status`` after each stage:
the bf16 checkpoint read in its own dtype as a streamed reference reads it on a GPU
(``models.loading.load_for_storage``), the decoder layers packed into their host buffers
(``StreamedLayers``), then the other parameters copied as their move to the GPU copies them.
``RssFile`` counts the checkpoint's pages mapped into the process (clean page cache the kernel
can reclaim), ``RssAnon`` the process's own memory. On a CPU the buffers are not page-locked
(torch's page-locked allocator would also round each up to a power of two).

    python bench/probes/streamed_host_memory_probe.py [--layers 24] [--hidden 1024]

Builds a random bf16 Llama in a temporary folder and reads it back in a fresh process; prints
one JSON line: the checkpoint's size and the resident set (MiB) after each stage.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def resident_mib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) // 1024
    return fields


def build(path: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def measure(path: Path) -> dict:
    import torch

    from dpocache.models.loading import load_for_storage
    from dpocache.models.streaming import StreamedLayers, move_resident_
    from dpocache.scoring.logprobs import decoder_layers

    stages = {"start": resident_mib()}
    model = load_for_storage(str(path), torch.bfloat16)
    stages["loaded"] = resident_mib()
    model.requires_grad_(False)
    layers = decoder_layers(model)
    move_resident_(model, layers, "cpu")
    streamer = StreamedLayers(model, layers, "cpu")
    gc.collect()
    stages["packed"] = resident_mib()
    streamed = {id(p) for layer in layers for p in layer.parameters()}
    for p in model.parameters():
        if id(p) not in streamed:
            p.data = p.data.clone()  # as their move to the GPU leaves no view of the file
    for b in model.buffers():
        b.data = b.data.clone()
    gc.collect()
    stages["rest_copied"] = resident_mib()
    return {"host_gib": streamer.to_json()["host_gib"], "stages_mib": stages}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the fresh process's part
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build(path, args.layers, args.hidden)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        out = subprocess.run([sys.executable, __file__, "--measure", str(path)], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
    print(json.dumps({"layers": args.layers, "hidden": args.hidden, "checkpoint_mib": size // 2**20,
                      **json.loads(out)}))


if __name__ == "__main__":
    main()
