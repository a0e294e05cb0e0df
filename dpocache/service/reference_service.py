"""The reference model as a service for online RL (GRPO, PPO, iterative DPO): token ids in,
per-token fp32 reference log-probs out.

``ReferenceService`` is a plain class: ``score(requests)`` takes requests
``{"prompt_ids": [...], "completion_ids": [[...], ...]}`` (a GRPO group of G, a DPO pair, a
single sequence) and returns, in request order, one ``(c,)`` fp32 CPU tensor per completion:
``log p(token | prompt, completion tokens before it)``. The work:

1. every (prompt, completion) is looked up in the look-aside cache (``cache_dir``, keyed by
   content under the model's namespace: weights, config, dtype) and among the call's other
   sequences; only what is new runs;
2. completions of one prompt share a row of the group layout (``dpocache.scoring.groups``), so the
   prompt runs once for the whole group; rows are length-grouped under ``max_tokens``;
3. the output head runs on completion positions only, in chunks (``CompletionLogProbs``).

``forward(input_ids, max_req_tokens, pad_id)`` is the same computation behind torchforge's
reference endpoint: a ``(G, T)`` batch of left-padded prompts and right-padded responses in,
``(G, T - max_req_tokens)`` response log-probs out. ``service.pool.ReferencePool`` spreads
``score`` over Ray actors (``pip install 'dpocache[ray]'``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import operator
import os
import threading
import time
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from dpocache.cache.build import default_max_tokens, namespace_for_dir, namespace_for_module, peak_memory_bytes
from dpocache.cache.fingerprint import config_sha256
from dpocache.cache.sequences import DEFAULT_MEMORY_BYTES, SequenceStore, sequence_key
from dpocache.cache.store import Namespace
from dpocache.config import whole_number, with_fields
from dpocache.models.directories import REFERENCES, reference_source
from dpocache.models.hub_ids import resolve_model_path
from dpocache.models.reference import DTYPES, ReferenceModel, dtype_name, resolve_dtype
from dpocache.runtime.preflight import check_model_dir, check_writable_dir, context_length
from dpocache.scoring.groups import Group, budget_batches, collate_groups, collate_sequences, per_sequence, split_group
from dpocache.scoring.layout_choice import CAUSAL, LAYOUTS, SHARED, shares_prompts
from dpocache.scoring.logprobs import scored_positions, unwrap_causal_lm

log = logging.getLogger(__name__)

Request = dict  # {"prompt_ids": [int, ...], "completion_ids": [[int, ...], ...]}
EXPECTED = "{'prompt_ids': [...], 'completion_ids': [[...], ...]}"

# Counters that add up over calls and over replicas (the others are derived or maxima).
SUMMED = ("calls", "requests", "sequences", "cache_hits", "duplicates", "forward_passes", "forward_sequences",
          "tokens", "sequence_tokens", "prompt_tokens_saved", "seconds", "score_seconds")


class RequestError(ValueError):
    """A bad request: names the request and, where it is one completion's fault, its index;
    ``field`` the request's field at fault (``prompt_ids``, ``completion_ids``; None: the request)."""

    def __init__(self, request: int, completion: int | None, reason: str, field: str | None = None):
        self.request, self.completion, self.reason = request, completion, reason
        self.field = field if field is not None or completion is None else "completion_ids"
        where = f"request {request}" + (f", completion {completion}" if completion is not None else "")
        super().__init__(f"{where}: {reason}")


def _ids(value: Any, request: int, completion: int | None, what: str, field: str | None = None) -> tuple[int, ...]:
    """Token ids from a list or tuple of integers (Python's or numpy's), a 1-D tensor or a numpy
    array; bools and floats are refused, naming what was found."""
    if (isinstance(value, torch.Tensor) or type(value).__module__ == "numpy") and getattr(value, "ndim", 1) != 1:
        raise RequestError(request, completion, f"{what} must be a 1-D tensor or list of token ids, got a "
                                                f"{value.ndim}-D {type(value).__name__} of shape {tuple(value.shape)}",
                           field)
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise RequestError(request, completion, f"{what} must be a list of token ids (ints), got "
                                                f"{type(value).__name__}", field)
    bad = next((t for t in value if type(t).__name__ in ("bool", "bool_") or not hasattr(t, "__index__")), None)
    if isinstance(bad, (list, tuple)):
        raise RequestError(request, completion, f"{what} must be one flat list of token ids (ints), got a list of "
                                                f"lists ({bad!r}, ...)", field)
    if bad is not None:
        raise RequestError(request, completion, f"{what} must be a list of token ids (ints), got a "
                                                f"{type(bad).__name__} ({bad!r})", field)
    if not value:
        raise RequestError(request, completion, f"empty {what}", field)
    return tuple(operator.index(t) for t in value)


def check_requests(requests: Any) -> Sequence[Request]:
    """``score``'s argument: a list of requests; one request alone (a dict) was read as a list of
    its keys, each "expected {...}"."""
    if isinstance(requests, dict):
        raise TypeError("score takes a list of requests; got one request (a dict): pass [request]")
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
        raise TypeError(f"score takes a list of requests, each {EXPECTED}; got {type(requests).__name__}")
    return requests if isinstance(requests, (list, tuple)) else list(requests)


def check_request(index: int, request: Any, vocab_size: int, context: int | None) -> tuple[tuple[int, ...], list]:
    """``(prompt ids, [completion ids, ...])`` of a valid request; else ``RequestError``."""
    if not isinstance(request, dict):
        raise RequestError(index, None, f"expected {EXPECTED}, got {type(request).__name__}")
    missing = [key for key in ("prompt_ids", "completion_ids") if key not in request]
    if missing:  # a misspelled key is the usual cause: the keys it has are named
        has = ", ".join(repr(k) for k in request) or "no key"
        raise RequestError(index, None, f"no {' and no '.join(repr(k) for k in missing)} (it has {has}); expected "
                                        f"{EXPECTED}", missing[0])
    prompt = _ids(request["prompt_ids"], index, None, "prompt", "prompt_ids")
    completions = request["completion_ids"]
    if isinstance(completions, torch.Tensor) or type(completions).__module__ == "numpy":
        completions = completions.tolist()
    if not isinstance(completions, (list, tuple)) or not completions:
        raise RequestError(index, None, "completion_ids must be a non-empty list of token-id lists", "completion_ids")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if t < 0 or t >= vocab_size)
        raise RequestError(index, None, f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                           "prompt_ids")
    out = []
    for k, c in enumerate(completions):
        c = _ids(c, index, k, "completion")
        if min(c) < 0 or max(c) >= vocab_size:
            bad = next(t for t in c if t < 0 or t >= vocab_size)
            raise RequestError(index, k, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
        if context is not None and len(prompt) + len(c) > context:
            raise RequestError(index, k, f"prompt + completion is {len(prompt) + len(c)} tokens, longer than the "
                               f"model's context ({context})")
        out.append(c)
    return prompt, out


def check_loading(dtype: str | torch.dtype, reference: str) -> None:
    """``from_pretrained``'s ``dtype`` and ``reference``, each named as the argument it is."""
    if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)} (or a torch.dtype); got {dtype!r}")
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {', '.join(REFERENCES)}; got {reference!r}")


def summed_stats(parts: Sequence[dict]) -> dict:
    """Counters of several services (replicas) as one: sums, the largest peak, averages again."""
    total = {k: sum(p.get(k, 0) for p in parts) for k in SUMMED}
    total["peak_memory_bytes"] = max((p.get("peak_memory_bytes", 0) for p in parts), default=0)
    return _derived(total)


def _derived(s: dict) -> dict:
    s["avg_sequence_length"] = s["sequence_tokens"] / s["forward_sequences"] if s["forward_sequences"] else 0.0
    s["tokens_per_s"] = s["tokens"] / s["seconds"] if s["seconds"] else 0.0
    return s


@dataclass
class _Work:
    """One call's new sequences: the groups to run and where each value goes."""

    groups: list[Group]
    keys: dict[bytes, list[tuple[int, int]]]  # sequence key -> every (request, completion) that asked for it
    group_keys: list[list[bytes]]  # the key of each completion of each group


# A request's completions share one run of their prompt only within a row of the budget
# (``groups.split_group``): a smaller budget splits the group and runs the prompt again. So the
# service's default budget is never below the one it was measured at, even where the offline
# pass takes a smaller one (a CPU's 1024).
GROUP_MAX_TOKENS = 4096


@dataclass(frozen=True)
class ServiceOptions:
    """How a reference service scores: one record from ``ReferencePool`` to each replica's
    service, and from ``from_pretrained`` to the constructor (which also take its fields as
    keyword arguments). The fields are ``ReferenceService``'s arguments documented there."""

    max_tokens: int | None = None
    cache_dir: str | Path | None = None
    compile: bool = False
    namespace: Namespace | None = None
    stats_file: str | Path | None = None
    layout: str = SHARED
    cache_memory_bytes: int = DEFAULT_MEMORY_BYTES
    temperature: float | None = None
    stream: bool = False

    def __post_init__(self) -> None:
        """Each field's type and range, named as the caller passes it, before any model loads (a
        ``ReferencePool`` checks here, not in each replica)."""
        if self.max_tokens is not None and not whole_number(self.max_tokens, 1):
            raise ValueError(f"max_tokens must be a whole number of at least 1 (None: the device's budget); "
                             f"got {self.max_tokens!r}")
        if not whole_number(self.cache_memory_bytes, 0):
            raise ValueError(f"cache_memory_bytes must be a whole number of at least 0; "
                             f"got {self.cache_memory_bytes!r}")
        real = isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
        if self.temperature is not None and not (real and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number above 0 (the rollouts' sampling temperature; "
                             f"None: 1); got {self.temperature!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}")
        for name in ("compile", "stream"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")

    @property
    def temperature_or_one(self) -> float:
        return 1.0 if self.temperature is None else self.temperature


class ReferenceService:
    """A frozen reference model behind ``score`` and ``forward``.

    Args:
        model: a causal LM (frozen here), or a ``ReferenceModel``.
        dtype: float32, or bfloat16/float16 under autocast (``ReferenceModel``).
        max_tokens: token slots per forward (rows x widest row); default: the device's budget
            (``cache.build.default_max_tokens``), at least ``GROUP_MAX_TOKENS``.
        cache_dir: where the look-aside cache lives (None: no cache).
        compile: compile each decoder layer once, at start (``dpocache.scoring.compiling``): worth it on
            a GPU for a service that runs a whole training job.
        namespace: the cache namespace; by default the model's weights and config by content.
        stats_file: a JSONL file that gets ``stats()`` after every ``score`` call.
        cache_memory_bytes: how many bytes of the look-aside cache's values stay in memory
            (default 1 GiB); past it the least recently used shards are dropped and read from
            disk again when asked for.
        temperature: the sampling temperature of the rollouts: the logits are divided by it
            before the log-softmax, as GRPO and PPO trainers (TRL, verl, OpenRLHF) do for the
            policy and the reference alike, so the KL is 0 where the policy equals the
            reference. Values at another temperature are cached under a namespace of their own.
            None: 1, or the temperature of the ``ReferenceModel`` given.
        stream: ``from_pretrained`` only: the decoder layers stay in host memory, each copied to
            the GPU as it runs (``dpocache.models.streaming``), so a reference beside the policy
            takes its embeddings, head and two layers of GPU memory. Eager layers (not with
            ``compile``).
    """

    def __init__(self, model: nn.Module | ReferenceModel, dtype: torch.dtype = torch.float32,
                 options: ServiceOptions | None = None, **fields):
        options = with_fields(ServiceOptions, options, fields)
        max_tokens, cache_dir, temperature = options.max_tokens, options.cache_dir, options.temperature
        self.options = options
        if isinstance(dtype, str):  # as from_pretrained takes it ("auto": by the model's device)
            dtype = resolve_dtype(dtype, next(model.parameters()).device if isinstance(model, nn.Module) else "cpu")
        self.reference = model if isinstance(model, ReferenceModel) else ReferenceModel(
            model, dtype, "on" if options.compile else "off", layout=options.layout,
            temperature=1.0 if temperature is None else temperature)
        if self.reference.layout_choice.attention == CAUSAL:
            # Its rows are the training layouts' (SequenceRows); a group row has none to give it.
            raise ValueError("the reference service needs an attention that takes a mask (sdpa, eager or flex); "
                             "this ReferenceModel runs dpocache's causal backend: build it with attention='sdpa'")
        if temperature is not None and self.reference.temperature != temperature:
            raise ValueError(f"temperature={temperature:g}, but the ReferenceModel given divides its logits by "
                             f"{self.reference.temperature:g}: build it with ReferenceModel(..., temperature=...)")
        self.device = torch.device(self.reference.device)
        config = unwrap_causal_lm(self.reference.model).config.get_text_config()
        self.vocab_size = int(config.vocab_size)
        self.context = context_length(config.to_dict())
        self.special_ids = special_token_ids(unwrap_causal_lm(self.reference.model))
        self.max_tokens = max_tokens or max(GROUP_MAX_TOKENS, default_max_tokens(self.reference.device))
        if cache_dir is not None:
            check_writable_dir(cache_dir, "cache_dir")  # one line, not the store's OSError at the first call
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.cache_memory_bytes = options.cache_memory_bytes
        self.store = None
        if cache_dir is not None:
            namespace = (replace(options.namespace, temperature=self.reference.temperature) if options.namespace
                         else self._namespace_by_content())
            self.store = SequenceStore(cache_dir, namespace, options.cache_memory_bytes)
            self._weights = self._weights_signature()
        self.stats_file = Path(options.stats_file) if options.stats_file else None
        self._counts = dict.fromkeys(SUMMED, 0)
        # One call at a time: the model runs one batch at a time anyway, and the store's pending
        # values and shard writes are not safe against a second thread.
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "auto",
                        device: str | torch.device | None = None, reference: str = "initial",
                        options: ServiceOptions | None = None, **fields) -> "ReferenceService":
        """A model directory. For a PEFT adapter directory the reference is the initial policy,
        base + that adapter (``reference="base"``: the bare base), as in ``dpocache train``."""
        options = with_fields(ServiceOptions, options, fields)  # one line naming a bad field
        check_loading(dtype, reference)
        # a Hub id: its snapshot in the local cache
        path = resolve_model_path(str(path), "ReferenceService.from_pretrained: path")
        check_model_dir(path, "path", tokenizer=False)  # one line, not transformers' traceback
        base, adapter = reference_source(path, reference)
        if options.cache_dir is not None:
            check_writable_dir(options.cache_dir, "cache_dir")  # before the model loads
        model = ReferenceModel.from_pretrained(base, dtype, device, compile="on" if options.compile else "off",
                                               layout=options.layout, adapter=adapter,
                                               temperature=options.temperature_or_one, stream=options.stream)
        if options.cache_dir is not None and options.namespace is None:
            options = replace(options, namespace=namespace_for_dir(path, model.dtype, options.cache_dir, reference))
        return cls(model, options=options)

    @classmethod
    def from_peft_policy(cls, policy: nn.Module, dtype: torch.dtype = torch.float32,
                         options: ServiceOptions | None = None, **fields) -> "ReferenceService":
        """The policy's base weights, its adapter disabled during every forward. Its namespace is
        that of the base weights alone (the adapter trains; the values do not depend on it)."""
        options = with_fields(ServiceOptions, options, fields)
        reference = ReferenceModel.from_peft_policy(policy, dtype, options.temperature_or_one)
        if options.cache_dir is not None and options.namespace is None:
            options = replace(options, namespace=base_namespace(policy, dtype))
        return cls(reference, options=options)

    # ------------------------------------------------------------------------------ scoring

    def score(self, requests: Sequence[Request]) -> list[list[torch.Tensor]]:
        """Per request, one ``(c_k,)`` fp32 CPU tensor of per-token log-probs per completion.
        Each tensor is the caller's own (editing it in place changes no later answer). Calls
        from several threads run one after another."""
        with self._lock:
            self._check_open()
            return self._score(requests)

    def close(self) -> None:
        """Let the model go (a GPU's memory with it, once nothing else holds it: a PEFT policy's
        base stays the policy's) and refuse later calls in one line; ``stats()`` still answers.
        The look-aside cache needs nothing: each call flushed it. Closing twice does nothing;
        ``with ReferenceService.from_pretrained(...) as service:`` closes it on leaving."""
        with self._lock:
            if self.reference is None:
                return
            on_gpu = self.device.type == "cuda"
            self.reference, self.store = None, None
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()

    def __enter__(self) -> "ReferenceService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.reference is None:
            raise RuntimeError("this ReferenceService was closed; start a new one")

    def _score(self, requests: Sequence[Request]) -> list[list[torch.Tensor]]:
        start = time.perf_counter()
        checked = [check_request(i, r, self.vocab_size, self.context) for i, r in enumerate(check_requests(requests))]
        results: list[list[torch.Tensor | None]] = [[None] * len(c) for _, c in checked]
        if self.store is not None:
            self._follow_weights()
            self.store.refresh()
        work = self._plan(checked, results)
        try:
            for group, values in self._run(work.groups):
                for key, value in zip(work.group_keys[group], values):
                    for r, k in work.keys[key]:
                        results[r][k] = value.clone()  # not the stored tensor, nor a duplicate's
                    if self.store is not None:
                        self.store.put(key, value)
        finally:
            if self.store is not None:
                # Before returning, and on an error or Ctrl-C: nothing computed is lost.
                self.store.flush()
        c = self._counts
        c["calls"] += 1
        c["requests"] += len(checked)
        c["sequences"] += sum(len(comps) for _, comps in checked)
        c["score_seconds"] += time.perf_counter() - start
        self._log_stats()
        return results  # type: ignore[return-value]

    def weights_changed(self) -> None:
        """Tell the service its weights changed where the per-call check cannot see it: a
        write through ``.data`` (no version counter) to values none of ``weights_signature``'s
        16 samples per tensor covers. The look-aside cache moves to the namespace of the weights
        as they are now, hashed in full. Without a ``cache_dir`` there is nothing to move."""
        with self._lock:
            self._check_open()
            if self.store is not None:
                self._weights = None  # unequal to any signature: _follow_weights re-hashes
                self._follow_weights()

    def _namespace_by_content(self) -> Namespace:
        """The namespace of the weights as they are now (a PEFT policy's: its base weights)."""
        if self.reference.adapter_disabled:
            namespace = base_namespace(self.reference.model, self.reference.dtype)
        else:
            namespace = namespace_for_module(unwrap_causal_lm(self.reference.model), self.reference.dtype)
        return replace(namespace, temperature=self.reference.temperature)

    def _weights_signature(self) -> tuple:
        # A PEFT policy's adapter trains while the service runs; the reference is its base.
        skip = "lora_" if self.reference.adapter_disabled else None
        return weights_signature(unwrap_causal_lm(self.reference.model), skip)

    def _follow_weights(self) -> None:
        """If the model's weights changed since the cache's namespace was taken (a reference
        synced to the policy, ``load_state_dict``), move to the namespace of the new weights:
        the old one's values are not theirs, and theirs must not be filed under it."""
        now = self._weights_signature()
        if now == self._weights:
            return
        old = self.store.namespace.id
        self.store.flush()
        self.store = SequenceStore(self.cache_dir, self._namespace_by_content(), self.cache_memory_bytes)
        self._weights = now
        log.info("the reference's weights changed: its look-aside cache moves from namespace %s to %s", old,
                 self.store.namespace.id)

    def _plan(self, checked: list, results: list) -> _Work:
        """Fill ``results`` from the cache; group what is left by prompt (a prompt asked by
        several requests runs once), each group within the token budget."""
        keys: dict[bytes, list[tuple[int, int]]] = {}
        by_prompt: dict[tuple[int, ...], tuple[int, list[bytes], list[tuple[int, ...]]]] = {}
        for r, (prompt, completions) in enumerate(checked):
            for k, comp in enumerate(completions):
                key = sequence_key(prompt, comp)
                if key in keys:
                    keys[key].append((r, k))
                    self._counts["duplicates"] += 1
                    continue
                cached = self.store.get(key) if self.store is not None else None
                if cached is not None:
                    results[r][k] = cached.clone()
                    self._counts["cache_hits"] += 1
                    continue
                keys[key] = [(r, k)]
                _, group_keys, comps = by_prompt.setdefault(prompt, (r, [], []))
                group_keys.append(key)
                comps.append(comp)
        groups, group_keys = [], []
        # The per-sequence fallback runs one row per sequence: groups of one, packed by length.
        budget = self.max_tokens if shares_prompts(self.reference.layout) else 0
        for prompt, (r, gkeys, comps) in by_prompt.items():
            for g in split_group(r, prompt, comps, range(len(comps)), budget):
                groups.append(g)
                group_keys.append([gkeys[i] for i in g.ids])
        return _Work(groups, keys, group_keys)

    def _run(self, groups: list[Group]):
        """Yields ``(group index, [(c,) fp32 CPU log-probs of each of its completions])``,
        batch after batch."""
        c = self._counts
        shared = shares_prompts(self.reference.layout)  # packed: groups as the shared layout runs them
        order = list(range(len(groups)))
        if shared:
            batches = budget_batches(order, self.max_tokens, width=lambda i: groups[i].unique_tokens)
        else:
            batches = budget_batches(order, self.max_tokens, width=lambda i: groups[i].padded_width,
                                     rows=lambda i: len(groups[i].completions))
        for batch in batches:
            tokens, seconds = self.reference.tokens, self.reference.seconds
            members = [groups[i] for i in batch]
            if shared:
                gb = collate_groups(members)
                parts = iter(self.reference.shared_prompt_logprobs(gb).float().cpu().split(gb.counts))
                c["prompt_tokens_saved"] += sum(len(g.prompt) * (len(g.completions) - 1) for g in members)
            else:
                sb = collate_sequences(members)
                token_logps = self.reference.logprobs(sb.input_ids, sb.attention_mask, sb.completion_mask,
                                                      scored_positions(sb.completion_mask))  # (N, T)
                parts = iter(per_sequence(token_logps.float().cpu(), sb))
            c["forward_passes"] += 1
            c["tokens"] += self.reference.tokens - tokens
            c["seconds"] += self.reference.seconds - seconds
            c["forward_sequences"] += sum(len(g.completions) for g in members)
            c["sequence_tokens"] += sum(g.sequence_tokens for g in members)
            for i, g in zip(batch, members):
                yield i, [next(parts) for _ in g.completions]

    # -------------------------------------------------------------------- torchforge's entry

    def forward(self, input_ids: torch.Tensor, max_req_tokens: int, pad_id: int,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """torchforge's reference endpoint: ``(G, T)`` rows of a prompt left-padded to
        ``max_req_tokens`` and a response right-padded → ``(G, T - max_req_tokens)`` fp32
        response log-probs on ``input_ids``' device, 0 at padding (and in a row whose response
        is all padding). Rows with the same prompt share one forward row.

        Padding is ``pad_id``, or where ``attention_mask`` (``(G, T)``, 1 at real tokens) is 0.
        The mask is needed when ``pad_id`` is the model's EOS or BOS id (common: GPT-2, Llama 3,
        Qwen), since a response's own EOS or a prompt's BOS would read as padding; ``forward``
        refuses such a ``pad_id`` without one."""
        requests, rows = forward_requests(input_ids, max_req_tokens, pad_id, attention_mask, self.special_ids)
        return forward_output(scored_rows(self.score, requests, rows), rows, input_ids, max_req_tokens)

    # -------------------------------------------------------------------------------- stats

    def stats(self) -> dict:
        """torchforge-style counters since construction (or ``reset_stats``):

        calls, requests, sequences (answered), cache_hits, duplicates (asked twice in a call),
        forward_passes, forward_sequences and tokens (run through the model), sequence_tokens
        (of those sequences as separate rows), prompt_tokens_saved (by sharing prompts),
        seconds (in forward passes), score_seconds (whole calls), peak_memory_bytes,
        avg_sequence_length, tokens_per_s."""
        s = dict(self._counts)
        s["peak_memory_bytes"] = peak_memory_bytes(self.device)
        return _derived(s)

    def reset_stats(self) -> None:
        self._counts = dict.fromkeys(SUMMED, 0)

    def _log_stats(self) -> None:
        if self.stats_file is None:
            return
        self.stats_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.stats_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **self.stats()}) + "\n")


def base_namespace(policy: nn.Module, dtype: torch.dtype) -> Namespace:
    """The namespace of a PEFT policy's base weights: adapter tensors left out and PEFT's
    ``base_layer`` renaming undone, so it equals that of the same weights without PEFT."""
    base = unwrap_causal_lm(policy)
    h = hashlib.sha256()
    kept = ((n.replace(".base_layer", ""), t) for n, t in base.state_dict().items() if "lora_" not in n)
    for name, tensor in sorted(kept, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return Namespace(h.hexdigest(), config_sha256(base.config.to_dict()), dtype_name(dtype),
                     model=f"<in memory {type(base).__name__}, adapter off>")


def special_token_ids(model: nn.Module) -> frozenset[int]:
    """The model's BOS and EOS ids, from its config and generation config."""
    ids: set[int] = set()
    for config in (model.config.get_text_config(), getattr(model, "generation_config", None)):
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None)
    return frozenset(ids)


def weights_signature(module: nn.Module, skip: str | None = None) -> tuple:
    """A cheap mark of ``module``'s weights (those whose name lacks ``skip``), equal until they
    change: each tensor's storage address and version counter (bumped by every in-place write
    through the tensor: ``load_state_dict``, an optimizer step) and 16 of its values, evenly
    strided (a write through ``.data`` has a version counter of its own). Hashing every weight
    on every call would cost a pass over the model's memory, so a ``.data`` write that misses
    every sample goes unseen: ``ReferenceService.weights_changed`` is the caller's way to say it."""
    tensors = [t.detach() for name, t in chain(module.named_parameters(), module.named_buffers())
               if skip is None or skip not in name]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # DTensor: this rank's shard
    marks = tuple((t.data_ptr(), t._version) for t in tensors)
    samples = [t.reshape(-1)[::max(1, t.numel() // 16)][:16].float() for t in tensors if t.numel()]
    sampled = torch.cat(samples).cpu().numpy().tobytes() if samples else b""
    return marks, hashlib.sha256(sampled).hexdigest()


def forward_requests(input_ids: torch.Tensor, max_req_tokens: int, pad_id: int,
                     attention_mask: torch.Tensor | None = None,
                     special_ids: frozenset[int] = frozenset()) -> tuple[list[Request], list]:
    """torchforge's ``(G, T)`` batch as requests (rows with the same prompt in one request), and
    per row ``(request, completion)`` or None for a row with no response token. Padding is
    ``pad_id`` (refused if in ``special_ids``, the model's BOS/EOS), or where ``attention_mask`` is 0."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a (G, T) tensor of token ids; got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or not 0 < max_req_tokens < input_ids.shape[1]:
        raise ValueError(f"input_ids must be (G, T) with 0 < max_req_tokens < T; got {tuple(input_ids.shape)} "
                         f"and max_req_tokens={max_req_tokens}")
    if attention_mask is None and pad_id in special_ids:
        raise ValueError(f"pad_id {pad_id} is also the model's BOS or EOS id: a response's own EOS (or a prompt's "
                         "BOS) cannot be told from padding; pass attention_mask, 1 at real tokens")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}; "
                         f"got {tuple(attention_mask.shape)}")
    masks = attention_mask.bool().tolist() if attention_mask is not None else None
    by_prompt: dict[tuple[int, ...], int] = {}
    requests: list[Request] = []
    rows: list[tuple[int, int] | None] = []
    for g, row in enumerate(input_ids.tolist()):
        prompt, response = row[:max_req_tokens], row[max_req_tokens:]
        if masks is None:
            start = next((i for i, t in enumerate(prompt) if t != pad_id), len(prompt))  # left padding
            end = len(response)
            while end and response[end - 1] == pad_id:  # right padding
                end -= 1
        else:
            real_prompt, real_response = masks[g][:max_req_tokens], masks[g][max_req_tokens:]
            start, end = len(prompt) - sum(real_prompt), sum(real_response)
            if real_prompt != [False] * start + [True] * (len(prompt) - start) or \
                    real_response != [True] * end + [False] * (len(response) - end):
                raise ValueError(f"attention_mask row {g}: the prompt must be left-padded and the response "
                                 "right-padded (0s only before the prompt and after the response)")
        if end == 0:
            rows.append(None)
            continue
        r = by_prompt.setdefault(tuple(prompt[start:]), len(requests))
        if r == len(requests):
            requests.append({"prompt_ids": prompt[start:], "completion_ids": []})
        requests[r]["completion_ids"].append(response[:end])
        rows.append((r, len(requests[r]["completion_ids"]) - 1))
    return requests, rows


def scored_rows(score, requests: list[Request], rows: list) -> list[list[torch.Tensor]]:
    """``score(requests)``, a bad request named by its row of the ``(G, T)`` batch."""
    try:
        return score(requests)
    except RequestError as e:
        row = rows.index((e.request, e.completion if e.completion is not None else 0))
        raise ValueError(f"input_ids row {row}: {e.reason}") from None


def forward_output(values: list[list[torch.Tensor]], rows: list, input_ids: torch.Tensor,
                   max_req_tokens: int) -> torch.Tensor:
    out = torch.zeros((input_ids.shape[0], input_ids.shape[1] - max_req_tokens), dtype=torch.float32)
    for g, where in enumerate(rows):
        if where is not None:
            v = values[where[0]][where[1]]
            out[g, :v.numel()] = v
    return out.to(input_ids.device)


# ------------------------------------------------------------------------------------- Ray
