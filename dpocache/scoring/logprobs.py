"""Per-token log-probabilities of completion tokens: the one function the cache build, training
and evaluation all use (docs/ARCHITECTURE.md), so the cached reference value is what the policy
computes at step 0, within fp32 rounding (inference takes each chunk's log-sum-exp in place,
training a log-softmax of it that autograd can run backward in one kernel).

Memory: a causal LM's forward returns logits ``(N, T, V)``; with V = 128k and fp32 that is the
largest tensor in a DPO step by far. Here the model's body runs alone, the hidden states of
the positions that predict a completion token are gathered ``(M, H)``, and the output head is
applied to them in chunks of rows, each chunk's logits ``(C, V)`` upcast to fp32 only for its
log-softmax. With gradients on, each chunk is checkpointed, so backward also holds one chunk
of logits at a time.

Heads that transform their logits are reproduced: Gemma 2's final soft-capping, Cohere's
``logit_scale``, Granite's ``logits_scaling``. A one-time probe compares the fast path with the
model's own forward on a few tokens; if they disagree (an unknown head), the module falls back
to the model's forward and says so once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpocache.scoring import bf16_matmul
from dpocache.scoring.attention import SequenceRows, compile_settings

log = logging.getLogger(__name__)

# fp32 logits held at once per chunk: 32M elements = 128 MiB.
DEFAULT_LOGITS_BUDGET = 1 << 25
# Logits per chunk for CPU inference that does not take the tiles below (bf16, heads that are
# not a plain nn.Linear): 16 MiB of fp32. On the 58m benchmark's head and whole reference pass
# these chunks ran faster than chunks of DEFAULT_LOGITS_BUDGET, and faster than smaller or larger
# ones (docs/benchmarks/levers-cpu-2core-20261123.md).
CPU_INFERENCE_LOGITS_BUDGET = 1 << 22
CPU_MIN_CHUNK_ROWS = 64
# fp32 CPU inference with a plain linear head goes further: tiles of rows x vocabulary whose
# logits (4 MiB) stay in cache while their log-sum-exp is taken, with an online rescaling
# across vocabulary tiles (as in flash attention's softmax). On the 58m benchmark (2 cores) the
# head in 1024 x 1024 tiles ran faster than in the row chunks above, and so did the whole
# reference pass; on the AVX2 machine every tile shape tried ran alike, so this one stays
# (``bench/probes/head_tiles.py``: docs/benchmarks/levers-cpu-2core-20261123.md).
CPU_TILE_ROWS = 1024
CPU_TILE_VOCAB = 1024


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside DDP / PEFT wrappers (same parameters)."""
    if hasattr(model, "module") and isinstance(getattr(model, "module"), nn.Module):  # DDP
        model = model.module
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):  # PEFT
        model = model.get_base_model()
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM (FSDP2's units; what ``--compile`` compiles): the
    modules whose class transformers lists in ``_no_split_modules`` (what accelerate and TRL
    shard on); else the largest ModuleList."""
    lm = unwrap_causal_lm(model)
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in lm.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def logit_transform(config, temperature: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model's own forward does to ``lm_head``'s output, from its config; then the
    division by a sampling ``temperature`` (1: none)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    divide = getattr(config, "logits_scaling", None)  # Granite divides

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if softcap is not None:
            # Gemma 2 (Gemma Team, 2024, arXiv 2408.00118, section 2): tanh soft-capping.
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
        return logits

    return transform


def scored_positions(completion_mask: torch.Tensor) -> torch.Tensor:
    """``(N, T)`` completion mask → ``(M,)`` long flat index ``n * T + t`` of each position ``t``
    whose next token is scored, in row-major order (a boolean selection's). Built on the host by
    the padded layout's collate (``scoring.padded``): on a GPU, finding them there would make the
    host wait for the device."""
    predicts = torch.zeros(completion_mask.shape, dtype=torch.bool, device=completion_mask.device)  # (N, T)
    predicts[:, :-1] = completion_mask[:, 1:].bool()  # position t predicts token t + 1
    return predicts.reshape(-1).nonzero().squeeze(1)


def _check_padded_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                         completion_mask: torch.Tensor | None) -> None:
    """The padded layout's masks in the shape of its ids (shapes only: nothing waits for a GPU).
    A label-style mask, shifted by one to ``(N, T - 1)``, would score the wrong tokens."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected (N, T) token ids, got shape {tuple(input_ids.shape)}")
    for name, mask in (("attention_mask", attention_mask), ("completion_mask", completion_mask)):
        if mask is None or mask.shape != input_ids.shape:
            got = "None" if mask is None else f"shape {tuple(mask.shape)}"
            why = (" (1 on each completion token itself, not shifted to the position that predicts it)"
                   if name == "completion_mask" else "")
            raise ValueError(f"{name}: expected the shape of input_ids {tuple(input_ids.shape)}, got {got}{why}")


def router_shape(config) -> tuple[int, int] | None:
    """(experts, experts per token) of a mixture-of-experts config, else None."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts or not hasattr(config, "output_router_logits"):
        return None
    return int(experts), int(getattr(config, "num_experts_per_tok", 2))


class CompletionLogProbs(nn.Module):
    """Wraps a causal LM; ``forward`` returns per-token log-probs of completion tokens.

    Being an ``nn.Module`` whose forward does the whole computation lets DDP and FSDP wrap it
    and see every parameter use in one forward call.

    Public API, for layouts that bring their own inputs (``docs/ARCHITECTURE.md``):

    - ``causal_lm``: the wrapped ``*ForCausalLM`` (looked up on each use).
    - ``body(input_ids, attention_mask, position_ids=None) -> hidden (N, T, H)``: the decoder,
      final norm applied; a mixture-of-experts model's router loss is kept in ``aux_loss``.
    - ``head_logps(hidden (M, H), labels (M,)) -> (M,)`` fp32: the output head on the gathered
      positions only, chunked (or tiled), with the model's logit transform and then the
      division by ``temperature`` (1 by default; online RL's sampling temperature).
    - ``gathered_logps``: ``body`` then ``head_logps`` at flat positions (``forward``'s gathered mode).
    - ``fast_path`` (``probe_fast_path``): whether ``head_logps`` reproduces the model's own head;
      ``router_loss``: whether the model has a MoE router loss.
    """

    def __init__(self, model: nn.Module, logits_budget: int = DEFAULT_LOGITS_BUDGET, probe: bool = True,
                 sum_sq_probs: bool = False, temperature: float = 1.0):
        """``model``: a ``*ForCausalLM`` (or PEFT- or DDP-wrapped one). ``logits_budget``: the
        most logits (tokens x vocabulary) one chunk of the head holds. ``probe``: check once,
        on a tiny input, that the body-then-head route gives the model's own logits (else every
        call runs the model's whole forward: ``fast_path`` False). ``sum_sq_probs``: also keep
        WPO's ``log sum_v p(v)^2`` of each scored position (``log_sum_sq_probs``).
        ``temperature``: what the logits are divided by (online RL's sampling temperature)."""
        super().__init__()
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number above 0; got {temperature}")
        self.model = model
        lm = unwrap_causal_lm(model)
        head = getattr(lm, "get_output_embeddings", None)
        headless = head is None or (head() is None and "For" not in type(lm).__name__)  # LlamaModel: no head
        if not hasattr(lm, "config") or headless:
            raise TypeError(f"model: expected a causal language model with its output head (a *ForCausalLM), got "
                            f"{type(lm).__name__}")
        # Under CPU bf16 autocast on a CPU without AMX, linear layers use the fp32 GEMM on
        # bf16-rounded operands (dpocache.scoring.bf16_matmul): the same numbers, faster there.
        bf16_matmul.install(model)
        self.config = lm.config
        self.logits_budget = logits_budget
        # The sampling temperature online RL divides the logits by, for the policy and the
        # reference alike (TRL's GRPO, verl, OpenRLHF), after the model's own transform.
        self.temperature = float(temperature)
        self._transform = logit_transform(lm.config, self.temperature)
        self._router = router_shape(lm.config)
        # MoE load-balancing loss of the last forward (a scalar in the graph), else None.
        self.aux_loss: torch.Tensor | None = None
        # WPO's weights (dpocache.losses.wpo) need log sum_v p(v)^2 at each scored position, which only
        # the full-vocabulary logits give: opt-in, taken from each chunk's logits while they exist
        # (one more (C, V) buffer per chunk, never (M, V)), detached. The last forward's values,
        # shaped like its output.
        self.sum_sq_probs = sum_sq_probs
        self.log_sum_sq_probs: torch.Tensor | None = None
        self.fast_path = True
        if probe:
            self.fast_path = self.probe_fast_path()

    # The body and head are looked up on each call: PEFT's disable_adapter and FSDP swap
    # wrappers in place, and a stale reference would bypass them.
    @property
    def causal_lm(self) -> nn.Module:
        """The wrapped ``*ForCausalLM`` (inside DDP / PEFT wrappers; the same parameters)."""
        return unwrap_causal_lm(self.model)

    @property
    def router_loss(self) -> bool:
        """True for a mixture-of-experts model whose forward adds a router load-balancing loss."""
        return self._router is not None

    def forward(self, input_ids: torch.Tensor, attention_mask, completion_mask: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, source: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, scored: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token log-probs of completion tokens, in the padded layout or (with ``source``) in
        a layout that brings its own mask and positions (``dpocache.scoring.shared``).

        Both go through this one ``forward`` so that DDP's and FSDP2's hooks (gradient
        reduction, parameter all-gather) run whichever layout a training run uses.

        Args (padded layout):
            input_ids: ``(N, T)`` token ids, right-padded.
            attention_mask: ``(N, T)`` 1 on real tokens, 0 on padding.
            completion_mask: ``(N, T)`` 1 on completion tokens (those scored), 0 on prompt and
                padding. Position 0 is never a completion token.
            scored: ``(M,)`` ``scored_positions(completion_mask)``, built on the host (None: found
                here, from the mask on its device).
        Returns:
            ``(N, T)`` float32: ``log p(token_t | tokens_<t)`` where ``completion_mask`` is 1,
            0 elsewhere.

        Args (gathered layout, ``source`` given):
            input_ids: ``(B, T)`` token ids.
            attention_mask: the body's custom mask, ``(B, 1, T, T)`` or ``{layer type: mask}``.
            position_ids: ``(B, T)``.
            source: ``(M,)`` flat index ``b * T + t`` of the position that predicts each scored token.
            labels: ``(M,)`` the scored token ids.
        Returns:
            ``(M,)`` float32 log-probs of the scored tokens.

        With ``sum_sq_probs`` set, ``self.log_sum_sq_probs`` holds, in the shape of the return
        value (0 off the completion), ``log sum_v p(v | tokens_<t)^2`` =
        ``logsumexp(2 * log_softmax(logits))`` of each scored position, detached (TRL's ``log_sum_sq_probs``).
        """
        if source is not None:
            return self.gathered_logps(input_ids, attention_mask, position_ids, source, labels)
        _check_padded_inputs(input_ids, attention_mask, completion_mask)
        if scored is None:
            scored = scored_positions(completion_mask)  # (M,)
        n, t = input_ids.shape
        predicted = scored + 1  # (M,) flat index of each scored token
        labels = input_ids.reshape(-1).index_select(0, predicted)  # (M,)
        if self.fast_path:
            hidden = self.body(input_ids, attention_mask)  # (N, T, H)
            picked = hidden.reshape(n * t, -1).index_select(0, scored)  # (M, H)
            logps = self.head_logps(picked, labels)  # (M,)
        else:
            moe = {"output_router_logits": True} if self._router else {}
            with compile_settings(self.config, input_ids.device):
                result = self.causal_lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **moe)
            self.aux_loss = getattr(result, "aux_loss", None)
            logits = result.logits
            full = (logits.reshape(n * t, -1).index_select(0, scored).float() / self.temperature).log_softmax(-1)
            logps = full.gather(-1, labels[:, None]).squeeze(-1)  # (M,)
            if self.sum_sq_probs:
                self.log_sum_sq_probs = (2 * full.detach()).logsumexp(-1)  # (M,)
        out = torch.zeros(n * t, dtype=torch.float32, device=input_ids.device)  # each token's value at its place
        if self.sum_sq_probs:  # (M,) -> (N, T) like the log-probs
            self.log_sum_sq_probs = out.index_copy(0, predicted, self.log_sum_sq_probs).view(n, t)
        return out.index_copy(0, predicted, logps).view(n, t)  # (N, T)

    def gathered_logps(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor, source: torch.Tensor,
                       labels: torch.Tensor) -> torch.Tensor:
        """``(M,)`` fp32 log-probs: the body on ``(B, T)`` rows with a custom mask and position
        ids, the hidden states at the flat positions ``source`` through the chunked head. Needs
        the fast path (a reproduced head) and no router loss (``dpocache.scoring.layout_choice``)."""
        hidden = self.body(input_ids, attention_mask, position_ids)  # (B, T, H)
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, source)  # (M, H)
        return self.head_logps(picked, labels)  # (M,)

    def body(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model's decoder on ``input_ids (N, T)`` → last hidden states ``(N, T, H)``, final
        norm applied. ``attention_mask``: ``(N, T)`` padding mask, or a layout's custom mask
        (``(N, 1, T, T)``, ``{layer type: mask}``, or the causal backend's ``SequenceRows``) with
        ``position_ids (N, T)``. For a
        mixture-of-experts model under a padding mask, the router loss goes to ``aux_loss``
        (the model's loss takes the 2D mask; a custom-mask layout never needs it:
        ``scoring.layout_choice``)."""
        lm = self.causal_lm
        positions = {} if position_ids is None else {"position_ids": position_ids}
        if isinstance(attention_mask, SequenceRows):  # the causal backend: its rows reach it as attention kwargs
            positions |= {"dpocache_gather": attention_mask.gather, "dpocache_scatter": attention_mask.scatter,
                          "dpocache_second": attention_mask.second}
            # A 4D mask is passed through as it is (transformers builds none); the backend ignores it.
            attention_mask = attention_mask.scatter.new_ones((1, 1, 1, 1), dtype=torch.bool)
        padding_mask = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
        moe = {} if self._router is None or not padding_mask else {"output_router_logits": True}
        with compile_settings(self.config, input_ids.device):
            out = lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **positions,
                                   **moe)
        if not moe:
            return out[0]  # last_hidden_state (N, T, H), final norm applied
        # The model's own load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4), from
        # the module that defines the architecture, so it is exactly what its forward computes.
        balance = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
        if balance is not None and out.router_logits is not None:
            experts, top_k = self._router
            self.aux_loss = balance(out.router_logits, experts, top_k, attention_mask)
        return out[0]

    def head_logps(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``hidden (M, H)``, ``labels (M,)`` → ``(M,)`` fp32 log-probs ``log p(label | hidden)``,
        the model's logit transform applied, in row chunks (or, for fp32 CPU inference, in tiles
        of rows x vocabulary); with gradients on, each chunk is recomputed in backward."""
        head = self.causal_lm.get_output_embeddings()
        if not self.sum_sq_probs and self._tiles_apply(head, hidden):  # the tiles compute log-probs only
            return self._tiled_head_logps(head, hidden, labels)
        vocab = max(1, self.config.get_text_config().vocab_size)
        rows = max(1, self.logits_budget // vocab)
        if hidden.device.type == "cpu" and not hidden.requires_grad:
            # CPU inference: chunks that stay under malloc's mmap threshold (dpocache.runtime.allocator)
            # are reused without page faults, and run faster than one large chunk; at least
            # CPU_MIN_CHUNK_ROWS rows, so the (V, H) weight is not re-read for a few rows.
            rows = min(rows, max(CPU_MIN_CHUNK_ROWS, CPU_INFERENCE_LOGITS_BUDGET // vocab))
        chunk_fn = self._chunk_logps_sum_sq if self.sum_sq_probs else self._chunk_logps
        parts = []
        for h, y in zip(hidden.split(rows), labels.split(rows)):
            if torch.is_grad_enabled() and h.requires_grad:
                # Recompute this chunk's logits in backward instead of keeping (C, V) alive.
                parts.append(checkpoint(chunk_fn, head, h, y, use_reentrant=False))
            else:
                parts.append(chunk_fn(head, h, y))
        if self.sum_sq_probs:  # (log-probs, log sum p^2) per chunk: keep the second, return the first
            self.log_sum_sq_probs = (torch.cat([sq for _, sq in parts]) if parts
                                     else hidden.new_zeros((0,), dtype=torch.float32))
            parts = [logps for logps, _ in parts]
        if not parts:
            return hidden.new_zeros((0,), dtype=torch.float32)
        return torch.cat(parts)

    @staticmethod
    def _tiles_apply(head: nn.Module, hidden: torch.Tensor) -> bool:
        """fp32 inference on CPU with a plain ``nn.Linear`` head (its weight is read directly)."""
        return (hidden.device.type == "cpu" and hidden.dtype == torch.float32 and not hidden.requires_grad
                and not torch.is_autocast_enabled("cpu") and type(head) is nn.Linear)

    def _tiled_head_logps(self, head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``hidden (M, H)``, ``labels (M,)`` → ``(M,)`` fp32 log-probs, in (rows x vocab) tiles.

        Per row: ``logit[label] - logsumexp(logits)``, the log-sum-exp accumulated over the
        vocabulary tiles with a running maximum ``top`` and a running ``total`` of
        ``exp(logit - top)``, rescaled by ``exp(old top - new top)`` when the maximum grows.
        """
        weight, bias = head.weight, head.bias  # (V, H), (V,) or None
        vocab = weight.shape[0]
        parts = []
        for h, y in zip(hidden.split(CPU_TILE_ROWS), labels.split(CPU_TILE_ROWS)):
            picked = h.new_empty(h.shape[0])  # (C,) logit of each row's label
            top = total = None  # (C,) each
            for start in range(0, vocab, CPU_TILE_VOCAB):
                stop = min(start + CPU_TILE_VOCAB, vocab)
                tile_bias = None if bias is None else bias[start:stop]
                logits = self._transform(F.linear(h, weight[start:stop], tile_bias))  # (C, Vt)
                rows = ((y >= start) & (y < stop)).nonzero().squeeze(-1)  # rows whose label is here
                picked[rows] = logits[rows, y[rows] - start]
                tile_top = logits.amax(-1)  # (C,)
                if top is None:
                    top, total = tile_top, logits.sub_(tile_top[:, None]).exp_().sum(-1)
                else:
                    new_top = torch.maximum(top, tile_top)
                    total = total * (top - new_top).exp_() + logits.sub_(new_top[:, None]).exp_().sum(-1)
                    top = new_top
            parts.append(picked - top - total.log())
        if not parts:
            return hidden.new_zeros((0,), dtype=torch.float32)
        return torch.cat(parts)

    def _chunk_logps(self, head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self._transform(head(h))  # (C, V) in the head's dtype
        if logits.requires_grad:
            # One log-softmax each way over the (C, V) logits, upcast for it: after the cast,
            # logsumexp's max, difference, exp and sum and their backwards were each a pass over a
            # whole fp32 (C, V) tensor, which a GPU's memory bounds (tests/scoring/test_logprobs.py).
            return torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, y[:, None]).squeeze(-1)
        logits = logits.float()  # (C, V), a fresh buffer
        picked = logits.gather(-1, y[:, None]).squeeze(-1)  # (C,)
        # No graph to keep: the logsumexp in place over the one (C, V) buffer, where
        # torch.logsumexp would allocate and stream a second one (the head is memory-bound).
        top = logits.amax(-1, keepdim=True)  # (C, 1)
        return picked - top.squeeze(-1) - logits.sub_(top).exp_().sum(-1).log()

    def _chunk_logps_sum_sq(self, head: nn.Module, h: torch.Tensor, y: torch.Tensor):
        """``_chunk_logps`` and, from the same ``(C, V)`` logits, WPO's ``log sum_v p(v)^2`` per
        row ``(C,)``, detached (TRL's ``log_sum_sq_probs``): both from one log-softmax, as in
        ``_chunk_logps``; ``exp(2 log p) <= 1`` cannot overflow, and is taken in place in one
        ``(C, V)`` buffer."""
        logp = torch.log_softmax(self._transform(head(h)), -1, dtype=torch.float32)  # (C, V)
        with torch.no_grad():
            sum_sq = logp.mul(2).exp_().sum(-1).log()  # (C,)
        return logp.gather(-1, y[:, None]).squeeze(-1), sum_sq

    @torch.no_grad()
    def probe_fast_path(self) -> bool:
        """Compare the fast path's output head with the model's own forward on a short sequence.

        One forward, not two: a hook takes the body's output (the hidden states the fast path
        starts from) during the model's own forward, and the chunked head is applied to it. The
        head is where architectures differ (soft-capping, logit scaling, custom heads); the body
        is the same module, called with the same inputs. For a 1B model on a CPU the forward is
        dominated by reading the weights, so a second forward was a measurable part of start-up
        on a cache hit (docs/benchmarks/levers-cpu-2core-20261123.md, "Start-up on a cache hit").
        """
        lm = self.causal_lm
        vocab = self.config.get_text_config().vocab_size
        device = next(lm.parameters()).device
        ids = (torch.arange(1, 13, device=device) * 7919 % vocab)[None]  # (1, 12)
        attn = torch.ones_like(ids)
        target = torch.zeros((1, 11), dtype=torch.bool, device=device)  # position t predicts token t+1
        target[:, 3:] = True  # tokens 4.. are scored
        captured = []
        hook = lm.get_decoder().register_forward_hook(lambda module, args, out: captured.append(out[0]))
        was_training = lm.training
        lm.eval()
        # A frozen reference whose matrices are stored in bf16 (dpocache.models.loading) beside fp32
        # embeddings runs under autocast only, as every forward of it does.
        lower = {p.dtype for p in lm.parameters()} - {torch.float32}

        def mixed():
            return autocast(next(iter(lower)), device) if len(lower) == 1 else contextlib.nullcontext()

        try:
            # Under the settings of every other forward: a model already run under FlexAttention on
            # the CPU would otherwise recompile its kernel for this shape with dynamic sizes.
            with compile_settings(self.config, device), mixed():
                logits = lm(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()  # (1, 12, V)
        finally:
            hook.remove()
            lm.train(was_training)
        labels = ids[:, 1:][target]  # (9,)
        naive = (logits[:, :-1][target] / self.temperature).log_softmax(-1)  # (9, V)
        naive = naive.gather(-1, labels[:, None]).squeeze(-1)  # (9,)
        if len(captured) != 1:
            log.warning("%s: its forward does not call its decoder once; using the full forward", type(lm).__name__)
            return False
        with mixed():
            fast = self.head_logps(captured[0][:, :-1][target], labels)  # (9,)
        tol = 5e-2 if lower else 1e-3
        err = (fast - naive).abs().max().item()
        if err > tol:
            log.warning(
                "%s: the chunked output head differs from the model's own forward by %.3g; "
                "falling back to the full forward (more memory: full logits are materialised)",
                type(lm).__name__, err,
            )
            return False
        return True


def scorer_core(scorer: nn.Module) -> CompletionLogProbs:
    """The ``CompletionLogProbs`` inside a DDP wrapper (FSDP2 shards it in place: itself)."""
    return scorer.module if isinstance(getattr(scorer, "module", None), CompletionLogProbs) else scorer


def autocast(dtype: torch.dtype, device: torch.device | str):
    """Mixed precision for ``dtype`` = bfloat16/float16 (weights stay as loaded); a no-op for
    float32. The cache build and training both enter it, so their numerics are the same."""
    device_type = torch.device(device).type
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
