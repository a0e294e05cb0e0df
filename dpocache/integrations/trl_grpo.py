"""``CachedGRPOTrainer``: TRL's ``GRPOTrainer`` with its reference pass through dpocache's service.

TRL 1.16's ``GRPOTrainer`` computes the reference's per-token log-probs in
``_generate_and_score_completions``: ``_get_per_token_logps_and_entropies(self.ref_model, ...)``
over the ``(B, P + C)`` batch of left-padded prompts and right-padded completions, keeping the
last ``logits_to_keep`` (= C) positions, the logits divided by ``args.temperature``; a PEFT
policy instead runs with its adapter disabled. That one call is all this subclass replaces:
``self.ref_model`` is a ``ServiceReference`` (no weights), and the override sends the batch to a
``ReferenceService`` or ``ReferencePool`` as token-id requests (padding stripped per row, the G
completions of a prompt in one request, so the prompt runs once for the group), at TRL's
temperature, and lays the answer out as TRL's ``(B, C)`` tensor, 0 at padding. Everything else
(generation, rewards, advantages, the loss, logging) is TRL's.

The reference (``reference=``):

- ``None``: what TRL takes: the policy's starting weights, read from ``model.config._name_or_path``
  (TRL loads its reference from there); a PEFT policy's base, its adapter disabled;
- a model directory or Hub id (a PEFT adapter directory: its base with that adapter on);
- a ``ReferenceService`` or a ``ReferencePool`` (replicas in other processes or on other GPUs
  through Ray: the trainer's process then holds no reference weights).

With ``beta=0`` the trainer is ``GRPOTrainer`` as it is and loads no reference. The look-aside
cache (``cache_dir``) is off by default (``cache``: sampled completions rarely repeat, in
evaluation too); a service or pool given brings its own. ``train()`` takes stop signals as
``dpocache train`` does (``trl_signals``): the running step finishes and is checkpointed. A
reference whose vocabulary or tokenizer differs from the policy's, or whose temperature differs
from ``args.temperature``, and a dataset prompt that leaves a completion of
``max_completion_length`` no room in the reference's context, are refused at construction with
one line.

Needs ``pip install 'dpocache[trl]'`` (TRL 1.16); other versions fail at construction with one
message, since this overrides TRL internals (``_get_per_token_logps_and_entropies``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dpocache.cache.build import default_cache_dir, namespace_for_dir
from dpocache.config import whole_number
from dpocache.integrations.trl import check_trl_internals, named_datasets
from dpocache.integrations.trl_signals import train_until_signal
from dpocache.models.directories import reference_source
from dpocache.models.hub_ids import resolve_model_path
from dpocache.models.reference import DTYPES, ReferenceModel, dtype_name, resolve_dtype
from dpocache.runtime.preflight import check_writable_dir
from dpocache.scoring.layout_choice import BF16_MATMUL_ENV
from dpocache.scoring.logprobs import unwrap_causal_lm
from dpocache.service.reference_service import (
    ReferenceService,
    ServiceOptions,
    forward_output,
    forward_requests,
    scored_rows,
)

try:
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.trainer.utils import get_config_model_id
except ImportError as e:  # the extra is optional; say how to get it
    raise ImportError("dpocache.integrations.trl_grpo needs TRL 1.16: pip install 'dpocache[trl]' "
                      "(in a clone of dpocache: pip install -e '.[trl]')") from e

log = logging.getLogger(__name__)

CACHE_MODES = ("never", "eval", "always")  # which completions go through the look-aside cache
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_HOOKS = ("_get_per_token_logps_and_entropies", "_generate_and_score_completions")


def check_trl_version(version: str | None = None) -> None:
    """``check_trl_internals`` for ``CachedGRPOTrainer``."""
    check_trl_internals("CachedGRPOTrainer", GRPOTrainer, _HOOKS, version)


@contextlib.contextmanager
def _rng_kept():
    """Run the body without moving torch's, Python's or numpy's random state: loading the
    reference must not change the completions TRL samples after it (GRPOTrainer seeds them at
    the end of its constructor, before this trainer loads its reference)."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


@contextlib.contextmanager
def _policy_arithmetic_kept():
    """Build a scorer around the policy TRL trains without switching its linear layers to the
    fp32 GEMM under CPU bf16 autocast (``dpocache.scoring.bf16_matmul``, on CPUs without AMX):
    the same values up to the order of summation, but not TRL's arithmetic for its policy."""
    before = os.environ.get(BF16_MATMUL_ENV)
    os.environ[BF16_MATMUL_ENV] = "native"
    try:
        yield
    finally:
        if before is None:
            del os.environ[BF16_MATMUL_ENV]
        else:
            os.environ[BF16_MATMUL_ENV] = before


def _loaded_from(service: Any) -> tuple[Path, ...]:
    """The local directories the model of a ``ReferenceService`` or ``ReferencePool`` given was
    loaded from, where its tokenizer may be saved: a service's model's config ``name_or_path``; a
    pool's ``model_dir`` (an adapter directory, then its base); none for a model built in memory."""
    model_dir = getattr(service, "model_dir", None)  # a ReferencePool: its models live in its replicas
    if isinstance(model_dir, Path) and model_dir.is_dir():
        base, _ = reference_source(model_dir)
        return (model_dir, Path(base))
    model = getattr(getattr(service, "reference", None), "model", None)
    if not isinstance(model, torch.nn.Module):
        return ()
    name = getattr(getattr(unwrap_causal_lm(model), "config", None), "name_or_path", "")
    return (Path(name),) if name and Path(name).is_dir() else ()


def _adapter_is_identity(model: Any) -> bool:
    """Whether a PEFT model's outputs equal its base's (a fresh adapter: LoRA's B starts at 0), on a
    few tokens, within rounding. Only then is TRL's reference (a frozen copy of the adapter as it
    starts) the base with the adapter disabled."""
    was_training = model.training
    model.eval()  # no dropout
    try:
        device = next(model.parameters()).device
        ids = torch.arange(1, 9, device=device)[None] % model.config.get_text_config().vocab_size
        on = model(input_ids=ids, use_cache=False).logits.float()
        with model.disable_adapter():
            off = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        model.train(was_training)
    return torch.allclose(on, off, rtol=1e-4, atol=1e-4)


def _service_temperature(service: Any) -> float | None:
    """The temperature a service or pool divides the logits by (None: it does not say)."""
    reference = getattr(service, "reference", None)
    if isinstance(reference, ReferenceModel):
        return reference.temperature
    return getattr(service, "temperature", None)


class ServiceReference:
    """What ``CachedGRPOTrainer`` puts in TRL's ``self.ref_model``: no weights, the services
    the reference pass goes to. ``train`` scores training batches; ``eval`` (built on first use)
    evaluation batches: with ``cache='eval'`` a service of its own, with the look-aside cache;
    otherwise ``train``."""

    def __init__(self, train: Any, description: str, eval_service: Any = None, make_eval=None):
        self.train = train
        self.description = description
        self._eval = eval_service
        self._make_eval = make_eval
        self.calls = {"train": 0, "eval": 0}
        self.seconds = {"train": 0.0, "eval": 0.0}

    @property
    def eval(self) -> Any:
        if self._eval is None:
            self._eval = self._make_eval() if self._make_eval is not None else self.train
        return self._eval

    def per_token_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                        evaluating: bool) -> torch.Tensor:
        """``(B, logits_to_keep)`` fp32 log-probs of the last ``logits_to_keep`` tokens of each
        row, 0 where ``attention_mask`` is 0: TRL's ``ref_per_token_logps``."""
        start = time.perf_counter()
        prompt_width = input_ids.shape[1] - logits_to_keep
        mode = "eval" if evaluating else "train"
        service = self.eval if evaluating else self.train
        # The mask says where padding is (pad may be EOS); forward_requests groups rows by prompt.
        requests, rows = forward_requests(input_ids, prompt_width, 0, attention_mask)
        out = forward_output(scored_rows(service.score, requests, rows), rows, input_ids, prompt_width)
        self.calls[mode] += 1
        self.seconds[mode] += time.perf_counter() - start
        return out

    def stats(self) -> dict:
        """The train service's counters (``ReferenceService.stats``) with this trainer's own for
        training's passes, ``trainer_calls`` and ``trainer_seconds`` (wall time of the reference
        pass, padding included), and under ``eval`` the same for evaluation's (its service's
        counters where it has a service of its own: ``cache='eval'``; otherwise the one service's
        counters at the top count both)."""
        def counters(service: Any, mode: str) -> dict:
            own = service.stats() if hasattr(service, "stats") else {}
            return {**own, "trainer_calls": self.calls[mode], "trainer_seconds": self.seconds[mode]}

        own_eval = self._eval if self._eval is not self.train else None  # None: not built, or the one service
        return {**counters(self.train, "train"), "eval": counters(own_eval, "eval")}


class CachedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose reference pass runs through dpocache's reference service.

    Args (beyond ``GRPOTrainer``'s):
        reference: ``None`` (TRL's reference: the policy's starting weights, or a PEFT policy's
            base), a model directory or Hub id, a ``ReferenceService`` or a ``ReferencePool``.
        cache_dir: the look-aside cache of a reference this trainer loads (default:
            ``$DPOCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpocache``, else ``~/.cache/dpocache``).
            A service or pool given uses its own.
        cache: which reference passes use it: ``never`` (default: TRL samples completions in
            evaluation as in training, and a hit needs the same completion token for token),
            ``eval`` (evaluation only) or ``always``.
        reference_dtype: ``float32``, ``bfloat16`` or ``float16`` of a reference this trainer
            loads. Default: TRL's: the policy's dtype, or bf16 / fp16 when ``args`` autocasts.
        reference_max_tokens: token slots per reference forward (default: the service's).
        reference_stream: keep the decoder layers of a reference this trainer loads (a model
            directory or Hub id) in host memory, each copied to the GPU as it runs
            (``dpocache.models.streaming``): the GPU holds its embeddings, head and two layers
            beside the policy, as verl's ``ref.fsdp_config.param_offload`` offloads its
            reference. Eager layers; not for a PEFT policy's base, which is the policy's own.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *rest: Any, reference: Any = None,
                 cache_dir: str | Path | None = None, cache: str = "never", reference_dtype: str | None = None,
                 reference_max_tokens: int | None = None, reference_stream: bool = False, **kwargs: Any):
        check_trl_version()
        self.dpocache_reference: ServiceReference | None = None
        given = _check_options(reference, cache_dir, cache, reference_dtype, reference_max_tokens, reference_stream)
        if args is None or args.beta == 0.0:  # GRPOTrainer as it is: no reference pass at all
            if given:
                log.warning("CachedGRPOTrainer: beta=0, so no reference runs and %s %s not used", ", ".join(given),
                            "is" if len(given) == 1 else "are")
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
            return
        _check_arguments(args, reference, cache_dir, cache)
        beta, args = args.beta, copy.copy(args)  # the caller's config is left as it is
        args.beta = 0.0  # so GRPOTrainer loads no reference model of its own (nor a "ref" adapter copy)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.beta = self.args.beta = beta
        if self._is_vlm:
            raise ValueError("CachedGRPOTrainer scores text only; a vision-language processor was given (use "
                             "GRPOTrainer, or beta=0)")
        self._cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self._cache = cache
        with _rng_kept():
            self.dpocache_reference = self._build_reference(reference, reference_dtype, reference_max_tokens,
                                                            reference_stream)
        self._check_reference(self.dpocache_reference.train)
        self._check_prompt_lengths(getattr(self.dpocache_reference.train, "context", None))
        self.ref_model = self.dpocache_reference  # TRL hands it back to _get_per_token_logps_and_entropies
        if self.accelerator.is_main_process:
            print(f"reference: {self.dpocache_reference.description}", file=sys.stderr)
        log.info("CachedGRPOTrainer: reference %s", self.dpocache_reference.description)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``GRPOTrainer.train``; a stop signal ends it at a saved step (``trl_signals``)."""
        return train_until_signal(self, super().train, *args, **kwargs)

    # ------------------------------------------------------------------------ the reference

    def _reference_dtype(self, explicit: str | None) -> torch.dtype:
        """TRL's: its reference is loaded in the policy's dtype and runs under ``args``' autocast."""
        if explicit is not None:
            return resolve_dtype(explicit, self.accelerator.device)
        weights = next(self.model.parameters()).dtype
        if weights in (torch.bfloat16, torch.float16):
            return weights
        return DTYPES["bfloat16" if self.args.bf16 else "float16" if self.args.fp16 else "float32"]

    def _options(self, max_tokens: int | None, cached: bool) -> ServiceOptions:
        return ServiceOptions(max_tokens=max_tokens, temperature=self.temperature,
                              cache_dir=self._cache_dir if cached else None)

    def _build_reference(self, reference: Any, dtype_name_: str | None, max_tokens: int | None,
                         stream: bool = False) -> ServiceReference:
        if reference is not None and not isinstance(reference, (str, Path)):
            loaded_from = _loaded_from(reference)
            if loaded_from:  # its vocabulary size alone misses a tokenizer of the same size
                self._check_tokenizer(*loaded_from)
            return ServiceReference(reference, f"{type(reference).__name__} given, at temperature "
                                               f"{self.temperature:g}")
        dtype = self._reference_dtype(dtype_name_)
        if reference is None and is_peft_model(self.model):
            return self._peft_reference(dtype, max_tokens)
        path = self._reference_path(reference)
        device = self.accelerator.device
        base, adapter = reference_source(path)
        self._check_tokenizer(path, base)
        # The model's own kernels, as TRL's policy runs (Liger's RoPE patch would reach the policy too).
        model = ReferenceModel.from_pretrained(base, dtype, device, adapter=adapter, temperature=self.temperature,
                                               kernels="none", stream=stream)

        def service(cached: bool) -> ReferenceService:
            options = self._options(max_tokens, cached)
            if cached:
                options = replace(options, namespace=namespace_for_dir(path, dtype, self._cache_dir))
            return ReferenceService(model, options=options)

        train = service(self._cache == "always")
        return ServiceReference(train, self._describe(path, dtype),
                                make_eval=None if self._cache != "eval" else lambda: service(True))

    def _peft_reference(self, dtype: torch.dtype, max_tokens: int | None) -> ServiceReference:
        """A PEFT policy's base, its adapter disabled (TRL's reference for a fresh adapter)."""
        if not _adapter_is_identity(self.model):
            raise ValueError("CachedGRPOTrainer: the PEFT policy's adapter already changes its outputs (a trained "
                             "adapter), so TRL's reference is a frozen copy of it, not the base; pass reference= the "
                             "adapter's directory (save_pretrained it first), or give the base and peft_config=")
        with _policy_arithmetic_kept():
            model = ReferenceModel.from_peft_policy(self.model, dtype, self.temperature)

        def service(cached: bool) -> ReferenceService:
            return ReferenceService(model, options=self._options(max_tokens, cached))

        train = service(self._cache == "always")
        return ServiceReference(train, self._describe("the PEFT policy's base (adapter disabled)", dtype),
                                make_eval=None if self._cache != "eval" else lambda: service(True))

    def _reference_path(self, reference: str | Path | None) -> Path:
        """The reference's local directory: ``reference``, or where TRL reads its own from."""
        given = str(reference) if reference is not None else get_config_model_id(self.model.config)
        what = "reference" if reference is not None else "model.config._name_or_path (TRL's reference)"
        path = resolve_model_path(given, f"CachedGRPOTrainer: {what}") if given else given
        if not path or not Path(path).expanduser().is_dir():
            raise ValueError(f"CachedGRPOTrainer: {what} is {given!r}, not a model directory or a Hub id in the local "
                             "cache; pass reference= the directory of the policy's starting weights, a "
                             "ReferenceService or a ReferencePool")
        return Path(path).expanduser()

    def _describe(self, source: Any, dtype: torch.dtype) -> str:
        cache = {"eval": f"look-aside cache for evaluation in {self._cache_dir}",
                 "always": f"look-aside cache in {self._cache_dir}", "never": "no look-aside cache"}[self._cache]
        return (f"{source} in {dtype_name(dtype)} on {self.accelerator.device}, at temperature {self.temperature:g}, "
                f"each group's prompt run once; {cache}")

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's per-token pass; with the ``ServiceReference`` TRL holds as ``ref_model``, the
        reference's values from the service (no entropies, as TRL asks none of the reference)."""
        if not isinstance(model, ServiceReference):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        extra = sorted(k for k, v in multimodal.items() if v is not None)
        if extra or compute_entropy or compute_aux_loss:
            raise ValueError(f"CachedGRPOTrainer: the reference service scores token ids only; TRL asked for "
                             f"{', '.join(extra) or 'entropies or an aux loss'}")
        mode = "train" if self.model.training else "eval"
        before = model.seconds[mode]
        logps = model.per_token_logps(input_ids, attention_mask, logits_to_keep, evaluating=mode == "eval")
        # In TRL's logs beside its own metrics: what the reference pass costs a step.
        self._metrics[mode]["reference/seconds"].append(model.seconds[mode] - before)
        return logps, None, None

    # ----------------------------------------------------------------------------- checks

    def _check_tokenizer(self, *dirs: Path) -> None:
        """The reference directory's tokenizer (the first of ``dirs`` that has one) must be the
        trainer's: the same tokens under the same ids, the same EOS."""
        found = next((d for d in dirs if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
        if found is None:
            return  # no tokenizer saved there: the vocabulary sizes are still compared
        from transformers import AutoTokenizer

        theirs, ours = AutoTokenizer.from_pretrained(str(found)), self._tokenizer
        vocab, own = theirs.get_vocab(), ours.get_vocab()
        if vocab != own:
            token = next((t for t in sorted(set(vocab) | set(own)) if vocab.get(t) != own.get(t)), None)
            raise ValueError(f"CachedGRPOTrainer: the reference's tokenizer ({found}) differs from the policy's: "
                             f"{len(vocab)} tokens against {len(own)}, first difference {token!r} (id "
                             f"{vocab.get(token)} against {own.get(token)}); the reference must share the policy's "
                             "tokenizer")
        if theirs.eos_token_id != ours.eos_token_id:
            raise ValueError(f"CachedGRPOTrainer: the reference's tokenizer ({found}) has EOS id "
                             f"{theirs.eos_token_id}, the policy's {ours.eos_token_id}; the reference must share the "
                             "policy's tokenizer")

    def _check_reference(self, service: Any) -> None:
        """One line naming what differs between the reference and the policy, before any step."""
        temperature = _service_temperature(service)
        if temperature is not None and abs(temperature - self.temperature) > 1e-12:
            raise ValueError(f"CachedGRPOTrainer: the reference divides its logits by temperature {temperature:g}, "
                             f"the trainer by args.temperature={self.temperature:g}; build the reference with "
                             f"temperature={self.temperature:g}")
        policy = self.model.config.get_text_config()
        ours, theirs = getattr(service, "vocab_size", None), int(policy.vocab_size)
        if ours is not None and ours != theirs:
            raise ValueError(f"CachedGRPOTrainer: the reference's vocabulary has {ours} tokens, the policy's "
                             f"{theirs}; the reference must share the policy's tokenizer and vocabulary")
        if ours is not None and len(self._tokenizer) > ours:
            raise ValueError(f"CachedGRPOTrainer: the tokenizer has {len(self._tokenizer)} tokens, more than the "
                             f"reference's vocabulary ({ours}); the reference must share the policy's tokenizer")
        # The reference refuses a prompt + completion past its context (service.check_request):
        # a completion as long as the context fits no prompt, and would stop the run at a step.
        context, longest = getattr(service, "context", None), self.args.max_completion_length
        if context is not None and longest is not None and longest >= context:
            raise ValueError(f"CachedGRPOTrainer: args.max_completion_length={longest} leaves no room for a prompt in "
                             f"the reference's context ({context} positions, from its config), which it refuses "
                             f"to score past; set max_completion_length so that prompt + completion fit {context}")

    def _check_prompt_lengths(self, context: int | None) -> None:
        """Every dataset prompt, with a completion of ``max_completion_length``, inside the
        reference's context: the reference refuses a longer sample, and TRL would sample it only
        at some step hours in. Prompts are measured as TRL tokenizes them (``_tokenize_prompts``),
        only where their text's UTF-8 bytes leave any doubt: a token covers at least one byte in
        byte-level BPE and SentencePiece vocabularies, so a prompt of fewer bytes than the room
        fits. Not checked: datasets without a length or a ``prompt`` column, and prompts built by
        a ``rollout_func`` or per environment (the step's refusal still names the row)."""
        longest = self.args.max_completion_length
        if (context is None or longest is None or self.rollout_func is not None
                or getattr(self, "environment_factories", None) is not None):
            return
        room = context - longest
        for name, dataset in named_datasets(self.train_dataset, self.eval_dataset).items():
            if hasattr(dataset, "__len__") and "prompt" in (getattr(dataset, "column_names", None) or ()):
                self._check_dataset_prompts(name, dataset, room, context)

    def _check_dataset_prompts(self, name: str, dataset: Any, room: int, context: int) -> None:
        """``_check_prompt_lengths`` over one dataset: one line naming its first prompt past ``room``."""
        past: list[tuple[int, int]] = []  # (row, tokens) of the prompts over room
        batch = 1024
        bar = tqdm(total=len(dataset), desc="prompt lengths", unit="prompts", dynamic_ncols=True,
                   disable=len(dataset) < 16 * batch or not self.accelerator.is_main_process)
        with bar:
            for start in range(0, len(dataset), batch):
                prompts = dataset[start:start + batch]["prompt"]
                doubtful = [i for i, size in enumerate(self._prompt_bytes(prompts)) if size > room]
                if doubtful:
                    lengths = [len(ids) for ids in self._tokenize_prompts([prompts[i] for i in doubtful])[0]]
                    past += [(start + i, n) for i, n in zip(doubtful, lengths) if n > room]
                bar.update(len(prompts))
        if past:
            (row, tokens), longest = past[0], max(n for _, n in past)
            completion = self.args.max_completion_length
            over, them = (f"{len(past)} prompts are", "them") if len(past) > 1 else ("1 prompt is", "it")
            fix = (f"drop {them}, or set max_completion_length to at most {context - longest}" if longest < context
                   else f"drop {them}: the longest fills the context alone")
            raise ValueError(f"CachedGRPOTrainer: {name} row {row}'s prompt is {tokens} tokens, so with "
                             f"args.max_completion_length={completion} a sample could reach {tokens + completion}, "
                             f"past the reference's context ({context} positions, from its config), which it "
                             f"refuses to score past; {over} over {room} tokens, the longest {longest}: {fix}")

    def _prompt_bytes(self, prompts: list) -> list[int]:
        """Per prompt, at least its token count: the UTF-8 bytes of the text TRL tokenizes (the chat
        template's rendering, or the string), the special tokens the tokenizer adds to a text (the
        rendering's are in it, which TRL tokenizes without them: a margin), and one for a prefix
        space."""
        if prompts and not isinstance(prompts[0], str):
            texts = self.processing_class.apply_chat_template(
                conversation=prompts, tools=self.tools or None, chat_template=self.chat_template,
                add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs)
        else:
            texts = prompts
        added = self._tokenizer.num_special_tokens_to_add()
        return [len(t.encode("utf-8")) + added + 1 for t in texts]


def _check_options(reference: Any, cache_dir: Any, cache: Any, dtype: Any, max_tokens: Any, stream: Any) -> list[str]:
    """This trainer's own arguments' types and values, whatever ``beta`` (one line naming the
    argument, before TRL loads anything); the names of those given other than by default."""
    if cache not in CACHE_MODES:
        raise ValueError(f"CachedGRPOTrainer: cache must be one of {', '.join(CACHE_MODES)}; got {cache!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"CachedGRPOTrainer: reference_dtype must be one of {', '.join(DTYPES)} (None: TRL's, the "
                         f"policy's dtype or args' bf16/fp16); got {dtype!r}")
    if max_tokens is not None and not whole_number(max_tokens, 1):
        raise ValueError(f"CachedGRPOTrainer: reference_max_tokens must be a whole number of at least 1 (None: the "
                         f"service's budget); got {max_tokens!r}")
    if not isinstance(stream, bool):
        raise ValueError(f"CachedGRPOTrainer: reference_stream must be True or False; got {stream!r}")
    loads = reference is None or isinstance(reference, (str, Path))
    if stream and not isinstance(reference, (str, Path)):
        raise ValueError("CachedGRPOTrainer: reference_stream=True streams a reference this trainer loads; pass "
                         "reference= a model directory or Hub id")
    if not loads and not callable(getattr(reference, "score", None)):
        raise ValueError(f"CachedGRPOTrainer: reference must be None, a model directory or Hub id, a ReferenceService "
                         f"or a ReferencePool; got {type(reference).__name__}")
    if not loads and cache_dir is not None:
        raise ValueError("CachedGRPOTrainer: cache_dir applies to a reference this trainer loads; a "
                         f"{type(reference).__name__} given uses its own (its cache_dir option)")
    if loads and cache == "never" and cache_dir is not None:  # else the directory would go unused, unsaid
        raise ValueError("CachedGRPOTrainer: cache_dir is where cache='eval' or cache='always' keeps the look-aside "
                         "cache, and cache is 'never' (the default): pass cache='eval' or 'always', or no cache_dir")
    if loads and cache != "never":
        try:  # the cache is written at the first evaluation or step: a bad directory is said now
            check_writable_dir(Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(),
                               "cache_dir")
        except ValueError as e:
            raise ValueError(f"CachedGRPOTrainer: {e} (cache={cache!r} writes the look-aside cache there)") from None
    values = {"reference": reference, "cache_dir": cache_dir, "cache": cache, "reference_dtype": dtype,
              "reference_max_tokens": max_tokens, "reference_stream": stream}
    defaults = {"cache": "never", "reference_stream": False}
    return [name for name, value in values.items() if value != defaults.get(name)]


def _check_arguments(args: Any, reference: Any, cache_dir: Any, cache: str) -> None:
    """What is wrong with these arguments for this ``args`` (a reference pass to run), before TRL
    loads anything."""
    if getattr(args, "sync_ref_model", False):
        raise ValueError("CachedGRPOTrainer: sync_ref_model=True would copy the policy into the reference during "
                         "training; dpocache's reference is fixed (use GRPOTrainer for a synced reference)")
    if reference is None or isinstance(reference, (str, Path)):
        return
    temperature = _service_temperature(reference)
    if temperature is not None and abs(temperature - args.temperature) > 1e-12:
        raise ValueError(f"CachedGRPOTrainer: the {type(reference).__name__} divides its logits by temperature "
                         f"{temperature:g}, the trainer by args.temperature={args.temperature:g}; build it with "
                         f"temperature={args.temperature:g}")
