"""The memory plan: per-device memory of the reference pass and of training, from a model's
config, a device count and a device size, before anything is loaded.

Every figure is a sum of named parts (weights, gradients, optimizer state, gathered FSDP units,
activations, output-head chunks), so a reader can see where the bytes go and check each part
against its formula. The parts follow what dpocache runs:

- **Reference pass** (``dpocache cache build``): inference only, so the weights and one layer's
  activations at a time; the output head runs on completion positions in chunks of
  ``DEFAULT_LOGITS_BUDGET`` fp32 logits (``dpocache.scoring.logprobs``). ``weight_bytes`` is 4 for the
  fp32 master weights loaded today, 2 for weights held in bf16. Sharded (FSDP2), a device holds
  1/N of the weights plus the units gathered at once: each matrix of a layer is a unit of its
  own (``dpocache.distributed.fsdp.matrix_units``), so two of the largest matrix (a gathered unit is held
  twice for a moment: its all-gather buffer and the parameters) and, with an untied head, one
  tile of a vocabulary table (the embeddings and the head are streamed from their shards,
  ``dpocache.distributed.vocab_stream``); with a tied head the root (embeddings, final norm, head:
  ``dpocache.distributed.fsdp``) is gathered too. Streamed (``--stream-reference``,
  ``dpocache.models.streaming``), a device holds the embeddings, the final norm, the head and
  two layer slots; the layers are in the host's page-locked memory, counted apart
  (``page_locked_bytes``).
- **Training** (full fine-tuning, FSDP2 over N devices, AdamW): fp32 master weights, fp32
  gradients and the two fp32 Adam moments, each sharded 1/N (16 bytes per parameter in all,
  ZeRO-3's accounting: Rajbhandari et al. 2020, section 3); gathered units in the compute dtype
  (``gather_bytes``: 4 with fp32 compute, 2 with bf16, FSDP2's ``MixedPrecisionPolicy``), plus one
  layer's unsharded fp32 gradient before its reduce-scatter; activations with
  per-layer checkpointing (each layer keeps its input, one layer's internals are live at a
  time); the checkpointed head chunk's logits and their gradient.
- **LoRA training** on one device (``lora_training_memory``; each DDP replica the same): the
  frozen base in bf16, resident or streamed (``--stream-base``), the adapters' fp32 state, the
  same checkpointed activations, and the products ``--checkpoint-keep`` keeps
  (``dpocache.models.checkpointing``; not the down projections', which the recompute skips
  instead, keeping nothing, unless ``--skip-unread-products false``), or the attention's output
  (``attention``: ``dpocache.models.kept_attention``).

Activation bytes per token of one decoder layer (bf16 autocast, SDPA so no ``T x T`` scores
kept) are ``ACTIVATION_HIDDEN_COEF * H + ACTIVATION_INTERMEDIATE_COEF * I`` bytes. The
coefficients were measured on a Llama decoder layer: the bytes autograd saves per token
(``tests/models/test_memory_plan.py`` measures them again and checks the formula).

Run ``python -m dpocache.models.memory_plan`` for the table of docs/memory.md, or pass
``--config config.json`` for any Llama-style model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from dpocache.config import KEEP_ATTENTION, ConfigError, checkpoint_keep_names
from dpocache.distributed.vocab_stream import TILE_BYTES
from dpocache.models.checkpointing import UNREAD_PRODUCTS
from dpocache.models.streaming import ALIGN, most_turn_layers
from dpocache.models.streaming import page_locked_bytes as streaming_page_locked_bytes
from dpocache.scoring.logprobs import DEFAULT_LOGITS_BUDGET

GIB = 1 << 30

# Autograd-saved bytes per token of one Llama decoder layer under bf16 autocast over fp32 weights,
# measured (saved_tensors_hooks, difference between two sequence lengths, at two widths each):
# 32 per hidden unit (the fp32 residual stream at both norms, the bf16 normed inputs, q, k, v,
# attention output) and 8 per MLP unit (gate, up and their product in bf16, the SiLU output).
# tests/models/test_memory_plan.py::test_activation_formula_matches_autograd measures it again.
ACTIVATION_HIDDEN_COEF = 32
ACTIVATION_INTERMEDIATE_COEF = 8
# Inference keeps nothing for backward; one layer's live tensors at its peak: the fp32 residual
# stream, the normed input, q/k/v and the attention output, the MLP's gate, up and product. An
# estimate from those tensors' sizes (not measured): it is small next to the weights.
INFERENCE_HIDDEN_COEF = 16
INFERENCE_INTERMEDIATE_COEF = 6
# Under autocast the residual stream between layers stays fp32 (fp32 input + bf16 block output).
RESIDUAL_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: embeddings, ``layers`` blocks (attention with ``kv_heads``
    grouped key/value heads, a gated MLP of width ``intermediate``), a final norm, a head."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    name: str = "model"

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelShape":
        """From a transformers config (object or dict, e.g. a ``config.json`` read as JSON)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(
            vocab=int(get("vocab_size")), hidden=hidden, layers=int(get("num_hidden_layers")),
            intermediate=int(get("intermediate_size")), heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim") or hidden // heads),
            tied=bool(get("tie_word_embeddings", False)), name=name or str(get("_name_or_path") or "model"),
        )

    @property
    def layer_params(self) -> int:
        """One decoder block: q and o projections, k and v (grouped), gate/up/down, two norms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = h * self.heads * self.head_dim * 2 + h * kv * 2
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each matrix of a decoder block, by its Llama name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def kept_bytes_per_token(self, name: str) -> int:
        """Bytes ``--checkpoint-keep`` keeps per token and block for ``name``: a matrix's product
        in bf16, or the attention's output in bf16 and its log-sum-exp in fp32 (one per head and
        row slot; a slot counted as a token, though a prompt has a copy in its pair's second row)."""
        if name == KEEP_ATTENTION:
            return self.heads * self.head_dim * 2 + self.heads * 4
        return self.linear_shapes[name][1] * 2

    @property
    def largest_matrix_params(self) -> int:
        """The largest matrix of a decoder block: an MLP projection, or the q/o projection."""
        return max(self.hidden * self.intermediate, self.hidden * self.heads * self.head_dim)

    @property
    def root_params(self) -> int:
        """What no layer owns: embeddings, final norm and (untied) output head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


# Public configs (Meta's Llama 3.1 config.json files).
LLAMA_3_8B = ModelShape(128256, 4096, 32, 14336, 32, 8, 128, name="Llama-3.1-8B")
LLAMA_3_70B = ModelShape(128256, 8192, 80, 28672, 64, 8, 128, name="Llama-3.1-70B")


def activation_bytes_per_token(shape: ModelShape) -> float:
    """Bytes autograd keeps per token for one decoder layer's backward (bf16 autocast)."""
    return ACTIVATION_HIDDEN_COEF * shape.hidden + ACTIVATION_INTERMEDIATE_COEF * shape.intermediate


def _head_chunk_bytes(shape: ModelShape, training: bool, tokens: int) -> float:
    """fp32 logits of one head chunk (``DEFAULT_LOGITS_BUDGET`` elements, at least a whole row,
    at most the ``tokens``' rows); training also holds their gradient and the recomputed chunk in
    backward."""
    elements = min(max(DEFAULT_LOGITS_BUDGET, shape.vocab), tokens * shape.vocab)
    return 4.0 * elements * (3 if training else 1)


def reference_memory(shape: ModelShape, devices: int = 1, tokens: int = 4096, weight_bytes: int = 2,
                     sharded: bool = False, streamed: bool = False) -> dict[str, float]:
    """Per-device bytes of the reference pass, by part.

    Args:
        tokens: tokens of one forward (the cache build's ``--max-tokens``).
        weight_bytes: 4 for fp32 weights (what ``cache build`` loads today), 2 for bf16.
        sharded: FSDP2 over ``devices`` (else every device holds the whole model).
        streamed: the decoder layers in host memory, two at a time on the device.
    """
    parts: dict[str, float] = {}
    if streamed:
        parts["embeddings, final norm, head"] = shape.root_params * weight_bytes
        parts["2 layer slots"] = 2 * shape.layer_params * weight_bytes
    elif sharded:
        parts["weights (1/N shard)"] = shape.params * weight_bytes / devices
        matrices = 2 * shape.largest_matrix_params * weight_bytes  # dpocache.distributed.fsdp.matrix_units
        if shape.tied:
            parts["gathered units (root + 2 matrices)"] = shape.root_params * weight_bytes + matrices
        else:  # the embeddings and the head are used a tile at a time, never gathered (distributed.vocab_stream)
            parts["gathered units (2 matrices + a vocabulary tile)"] = matrices + TILE_BYTES
    else:
        parts["weights"] = shape.params * weight_bytes
    per_token = INFERENCE_HIDDEN_COEF * shape.hidden + INFERENCE_INTERMEDIATE_COEF * shape.intermediate
    parts["activations (one layer)"] = tokens * per_token
    parts["head chunk logits"] = _head_chunk_bytes(shape, training=False, tokens=tokens)
    return parts


def training_memory(shape: ModelShape, devices: int, tokens: int = 4096, gather_bytes: int = 4) -> dict[str, float]:
    """Per-device bytes of full fine-tuning with FSDP2 over ``devices`` (``tokens`` per micro-batch
    per device, the two completions of each pair included), with per-layer activation
    checkpointing (``--gradient-checkpointing``; without it every layer keeps its activations)."""
    p, n = shape.params, devices
    return {
        "fp32 weights (1/N)": 4.0 * p / n,
        "fp32 gradients (1/N)": 4.0 * p / n,
        "AdamW moments (1/N)": 8.0 * p / n,
        "gathered units (root + 2 layers)": (shape.root_params + 2 * shape.layer_params) * gather_bytes,
        "unsharded layer gradient": 4.0 * shape.layer_params,
        "checkpointed layer inputs": float(tokens * shape.hidden * RESIDUAL_BYTES * shape.layers),
        "activations (one layer, recomputed)": tokens * activation_bytes_per_token(shape),
        "head chunk logits + grad": _head_chunk_bytes(shape, training=True, tokens=tokens),
    }


def lora_training_memory(shape: ModelShape, tokens: int = 4096, rank: int = 16, streamed: bool = False,
                         keep: tuple[str, ...] = (), resident: int = 0) -> dict[str, float]:
    """Bytes of a LoRA run on one device (each DDP replica holds the same), by part: the frozen
    base in bf16 (a checkpoint saved in bf16, the embeddings included: ``load_policy``), or with
    ``streamed`` (``--stream-base``) its root, two layer slots and ``resident`` decoder layers
    kept on the device (``--resident-layers``); an adapter of ``rank`` on every
    matrix of every block (fp32 weights, gradients and AdamW moments: 16 bytes per parameter);
    per-layer checkpointing (``--gradient-checkpointing``, which ``--stream-base`` needs): the
    layers' fp32 inputs, one layer's activations in the recompute (the adapters' own, ``rank``
    wide, not counted), the head chunk; and the products of the matrices named in ``keep``
    (``--checkpoint-keep``), ``tokens`` x out_features in bf16 per block (``attention``: its
    output and log-sum-exp, ``ModelShape.kept_bytes_per_token``)."""
    parts = _lora_held_memory(shape, rank, streamed, resident)
    parts["checkpointed layer inputs"] = float(tokens * shape.hidden * RESIDUAL_BYTES * shape.layers)
    parts["activations (one layer, recomputed)"] = tokens * activation_bytes_per_token(shape)
    if keep:
        kept = sum(shape.kept_bytes_per_token(name) for name in keep)
        parts[f"kept products ({', '.join(keep)})"] = float(tokens * kept * shape.layers)
    parts["head chunk logits + grad"] = _head_chunk_bytes(shape, training=True, tokens=tokens)
    return parts


def _lora_held_memory(shape: ModelShape, rank: int, streamed: bool, resident: int) -> dict[str, float]:
    """What a LoRA run holds through its whole step: the frozen base (or, streamed, its root,
    two layer slots and the resident layers) and the adapters' fp32 state."""
    parts: dict[str, float] = {}
    if streamed:
        parts["embeddings, final norm, head (bf16)"] = shape.root_params * 2.0
        parts["2 layer slots (bf16)"] = 2 * shape.layer_params * 2.0
        if resident:
            parts[f"{resident} resident layers (bf16)"] = resident * shape.layer_params * 2.0
    else:
        parts["bf16 base"] = shape.params * 2.0
    adapter_params = shape.layers * rank * sum(i + o for i, o in shape.linear_shapes.values())
    parts["adapters (fp32, gradients, AdamW)"] = 16.0 * adapter_params
    return parts


def lora_bottom_turn_memory(shape: ModelShape, tokens: int = 4096, rank: int = 16, keep: tuple[str, ...] = (),
                            resident: int = 0, turn: int = 0) -> dict[str, float]:
    """Bytes of a streamed LoRA run at its bottom turn (the end of a backward, the start of the
    next forward), by part, with ``turn`` layers kept there (``--turn-layers``): what
    ``lora_training_memory`` holds throughout (the root, two slots, the resident layers, the
    adapters' state), the kept layers' slots, and the first layer's checkpointed input, kept
    products and activations; every layer above has given its own back, and the head's chunk
    is done."""
    parts = _lora_held_memory(shape, rank, streamed=True, resident=resident)
    if turn:
        parts[f"{turn} layers kept through the turn (bf16)"] = turn * shape.layer_params * 2.0
    parts["the first layer's checkpointed input"] = float(tokens * shape.hidden * RESIDUAL_BYTES)
    parts["activations (one layer, recomputed)"] = tokens * activation_bytes_per_token(shape)
    if keep:
        parts["the first layer's kept products"] = float(tokens * sum(shape.kept_bytes_per_token(n) for n in keep))
    return parts


def turn_layers_below_peak(shape: ModelShape, tokens: int = 4096, rank: int = 16, keep: tuple[str, ...] = (),
                           resident: int = 0) -> int:
    """The most ``--turn-layers`` whose bottom turn (``lora_bottom_turn_memory``) stays at or
    below the step's peak (``lora_training_memory``, streamed), within the bound the streaming
    sets (``streaming.most_turn_layers``)."""
    peak = sum(lora_training_memory(shape, tokens, rank, streamed=True, keep=keep, resident=resident).values())
    bottom = sum(lora_bottom_turn_memory(shape, tokens, rank, keep, resident).values())
    room = int((peak - bottom) // (shape.layer_params * 2.0))
    return max(min(room, most_turn_layers(shape.layers - resident)), 0)


def page_locked_bytes(shape: ModelShape, streamed_layers: int) -> int:
    """The host's page-locked bytes of ``streamed_layers`` decoder layers in bf16, as
    ``StreamedLayers`` allocates them: several layers to an allocation, each allocation rounded
    up to a power of two by torch's page-locked allocator (``streaming.page_locked_chunks``)."""
    layer = -(-2 * shape.layer_params // ALIGN) * ALIGN
    return streaming_page_locked_bytes([layer] * streamed_layers)


@dataclass
class PlanRow:
    model: str
    job: str
    devices: int
    per_device_gib: float
    fits: bool
    parts: dict[str, float]
    host_gib: float | None = None  # a streamed row's page-locked host memory (page_locked_bytes)


def plan(shape: ModelShape, device_counts=(1, 8, 16), device_gib: float = 80.0, tokens: int = 4096,
         usable: float = 0.9, lora_rank: int = 16, keep: tuple[str, ...] = (),
         resident: int = 10) -> list[PlanRow]:
    """Rows for the reference pass (fp32 unsharded, bf16 unsharded, bf16 sharded, bf16 streamed on
    one device), FSDP2 training (fp32 compute, bf16 compute) on each device count, and LoRA
    training of rank ``lora_rank`` on one device (its base resident, streamed, streamed with the
    products of ``keep`` kept, and that with ``resident`` layers on the device). ``usable`` leaves
    room for the CUDA context, allocator fragmentation and communication buffers."""
    rows = []
    lora = f"training, LoRA r{lora_rank}, bf16 base"
    for n in device_counts:
        jobs = {
            "reference, fp32 weights, whole model per device": reference_memory(shape, n, tokens, 4, sharded=False),
            "reference, bf16 weights, whole model per device": reference_memory(shape, n, tokens, 2, sharded=False),
            "reference, bf16 weights, FSDP2-sharded": reference_memory(shape, n, tokens, 2, sharded=True),
            "reference, bf16 weights, layers streamed from host": reference_memory(shape, n, tokens, 2,
                                                                                    streamed=True),
            "training, FSDP2 (fp32 compute)": training_memory(shape, n, tokens, gather_bytes=4),
            "training, FSDP2 (bf16 compute)": training_memory(shape, n, tokens, gather_bytes=2),
            f"{lora}, checkpointed": lora_training_memory(shape, tokens, lora_rank),
            f"{lora} streamed from host": lora_training_memory(shape, tokens, lora_rank, streamed=True),
        }
        if keep:
            jobs[f"{lora} streamed, {','.join(keep)} kept"] = lora_training_memory(shape, tokens, lora_rank,
                                                                                streamed=True, keep=keep)
        if 0 < resident < shape.layers:
            kept = f", {','.join(keep)} kept" if keep else ""
            jobs[f"{lora} streamed, {resident} layers resident{kept}"] = lora_training_memory(
                shape, tokens, lora_rank, streamed=True, keep=keep, resident=resident)
        for job, parts in jobs.items():
            one_device = "streamed" in job or "LoRA" in job  # the same on every DDP replica
            if ("sharded" in job and n == 1) or (one_device and n > 1):
                continue
            total = sum(parts.values()) / GIB
            streamed = shape.layers - (resident if "layers resident" in job else 0) if "streamed" in job else 0
            host = page_locked_bytes(shape, streamed) / GIB if streamed else None
            rows.append(PlanRow(shape.name, job, n, total, total <= usable * device_gib, parts, host))
    return rows


def format_table(rows: list[PlanRow], device_gib: float) -> str:
    lines = [f"| model | job | devices | GiB per device | fits in {device_gib:g} GiB | host page-locked GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        host = "-" if r.host_gib is None else f"{r.host_gib:.1f}"
        lines.append(f"| {r.model} | {r.job} | {r.devices} | {r.per_device_gib:.1f} | {'yes' if r.fits else 'no'} "
                     f"| {host} |")
    return "\n".join(lines)


DEFAULT_RESIDENT = 10  # the last streamed LoRA row's layers on the device, where the model has more


def _shape(path: Path, parser: argparse.ArgumentParser) -> ModelShape:
    """``--config``'s model: a ``config.json`` or the model directory holding one; one line for
    anything else (a missing file, JSON that is not a config, a model that is no Llama-style
    decoder, whose shapes this plan does not know)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
        return ModelShape.from_config(config, name=file.parent.name or file.stem)
    except OSError as e:
        parser.error(f"--config {path}: cannot read {file} ({e.strerror or e})")
    except ValueError as e:
        parser.error(f"--config {path}: {file} is not JSON ({e})")
    except (TypeError, KeyError, AttributeError):
        parser.error(f"--config {path}: not a Llama-style decoder's config (hidden_size, num_hidden_layers, "
                     "intermediate_size, num_attention_heads, vocab_size), whose memory this plan counts")
    raise AssertionError("parser.error exits")


def check_turn_layers(parser: argparse.ArgumentParser, turn: int | None, shapes: list[ModelShape],
                      resident: int) -> None:
    """``--turn-layers`` within what ``train`` takes for each model's streamed row
    (``streaming.most_turn_layers``): a count past it was planned here and refused there."""
    if turn is None:
        return
    if turn < 0:
        parser.error(f"--turn-layers: must be at least 0, got {turn}")
    for s in shapes:
        most = most_turn_layers(s.layers - resident) if 0 < resident < s.layers else None
        if most is not None and turn > most:
            parser.error(f"--turn-layers {turn}: at most {most} for the {s.layers - resident} layers {s.name} "
                         f"streams with --resident-layers {resident}, as train takes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpocache.memory_plan",
                                     description="Per-device memory of the reference pass and of training.")
    parser.add_argument("--config", type=Path, action="append",
                        help="a model's config.json or its directory (repeatable; default: Llama 3.1 8B and 70B)")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--device-gib", type=float, default=80.0)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per forward / micro-batch per device")
    parser.add_argument("--parts", action="store_true", help="also print each row's parts")
    parser.add_argument("--lora-r", type=int, default=16, help="the LoRA rows' adapter rank (every matrix adapted)")
    parser.add_argument("--checkpoint-keep", default="none",
                        help="matrices whose products the last LoRA rows keep, or attention (its output; "
                             "comma-separated; none: no such row)")
    parser.add_argument("--skip-unread-products", choices=("true", "false"), default="true", nargs="?", const="true",
                        help="the recompute skips the down projections' products, which the backward never reads: "
                             "--checkpoint-keep does not keep them (as train does; default true)")
    parser.add_argument("--resident-layers", type=int, default=None,
                        help="decoder layers the last streamed LoRA row keeps on the device (0: no such row; "
                             f"default {DEFAULT_RESIDENT}, where the model has more)")
    parser.add_argument("--turn-layers", type=int, default=None,
                        help="the last streamed LoRA row's bottom turn with this many layers kept (default: the "
                             "most that stay below its peak)")
    args = parser.parse_args(argv)
    for flag, values, least in (("--devices", args.devices, 1), ("--tokens", [args.tokens], 1),
                                ("--lora-r", [args.lora_r], 1), ("--resident-layers", [args.resident_layers or 0], 0)):
        if min(values) < least:  # --lora-r 0 is full fine-tuning in train: the full rows here
            parser.error(f"{flag}: must be at least {least}, got {min(values)}")
    if args.device_gib <= 0:
        parser.error(f"--device-gib: must be above 0, got {args.device_gib:g}")
    try:
        keep = checkpoint_keep_names(args.checkpoint_keep)
    except ConfigError as e:
        parser.error(str(e))
    unknown = sorted(set(keep) - set(LLAMA_3_8B.linear_shapes) - {KEEP_ATTENTION})
    if unknown:
        parser.error(f"--checkpoint-keep: {unknown[0]!r} is no matrix of a Llama block "
                     f"({', '.join(LLAMA_3_8B.linear_shapes)}) nor {KEEP_ATTENTION}")
    unread = [name for name in keep if name in UNREAD_PRODUCTS["LlamaDecoderLayer"]]
    if unread and args.skip_unread_products == "true":
        print(f"{', '.join(unread)}: skipped in the recompute, not kept (--skip-unread-products false keeps it)\n")
        keep = tuple(name for name in keep if name not in unread)
    shapes = [_shape(p, parser) for p in args.config] if args.config else [LLAMA_3_8B, LLAMA_3_70B]
    for s in shapes if args.resident_layers is not None else ():  # the default leaves a small model's row out
        if args.resident_layers >= s.layers:
            parser.error(f"--resident-layers {args.resident_layers}: {s.name} has {s.layers} decoder layers; keep "
                         "fewer on the device for a streamed row (0: no such row)")
    if args.resident_layers is None:
        args.resident_layers = DEFAULT_RESIDENT
    check_turn_layers(parser, args.turn_layers, shapes, args.resident_layers)
    rows = [row for s in shapes for row in plan(s, args.devices, args.device_gib, args.tokens,
                                                lora_rank=args.lora_r, keep=keep, resident=args.resident_layers)]
    print(format_table(rows, args.device_gib))
    for s in shapes:  # --turn-layers: the layers kept through the bottom turn, against the step's peak
        if not 0 < args.resident_layers < s.layers:
            continue
        most = turn_layers_below_peak(s, args.tokens, args.lora_r, keep, args.resident_layers)
        turn = most if args.turn_layers is None else args.turn_layers
        bottom = sum(lora_bottom_turn_memory(s, args.tokens, args.lora_r, keep, args.resident_layers, turn).values())
        peak = sum(lora_training_memory(s, args.tokens, args.lora_r, streamed=True, keep=keep,
                                        resident=args.resident_layers).values())
        print(f"\n{s.name}, LoRA streamed, {args.resident_layers} resident: --turn-layers {turn} takes "
              f"{bottom / GIB:.1f} GiB at the bottom turn against the step's {peak / GIB:.1f} GiB peak; "
              f"at most {most} stay below it")
    if args.parts:
        for r in rows:
            print(f"\n{r.model}, {r.job}, {r.devices} devices:")
            for name, value in r.parts.items():
                print(f"  {name:<40} {value / GIB:8.2f} GiB")


if __name__ == "__main__":
    main()
