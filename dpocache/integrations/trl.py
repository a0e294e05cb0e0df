"""``CachedDPOTrainer``: TRL's ``DPOTrainer`` with its reference values from dpocache's cache.

With ``precompute_ref_log_probs`` set, TRL's ``DPOTrainer`` fills the dataset columns
``ref_chosen_logps`` and ``ref_rejected_logps`` in its own pass (``_precompute_ref_logps``), and
``_compute_loss`` then reads them from each batch instead of running a reference forward (TRL
never takes such columns from the input data: without that flag it ignores them, with it it
recomputes them). This subclass overrides that pass to fill the columns from dpocache's
content-addressed cache: each pair is keyed by its token ids (after TRL's
tokenization and the collator's truncation), so a second run with shuffled, extended or
re-split data reuses every value, and only missing pairs are scored, by dpocache's engine.

TRL's reference is the module it is given: ``ref_model``, or ``model`` as passed (with a PEFT
adapter on, that adapter as it is at construction). dpocache computes its reference from files:
``cache_reference``, by default the directory that module was loaded from (``name_or_path``); a
PEFT adapter directory means its base with that adapter on. So that the two cannot silently
differ, construction compares a few values of every tensor in those files (memory-mapped) with
the module, and refuses a module changed since it was loaded (trained, merged, edited) or one
carrying a trained adapter whose directory was not given.

Needs ``pip install 'dpocache[trl]'`` (TRL 1.16); other TRL versions fail at construction with
one message, since this overrides TRL internals (``_precompute_ref_logps``).
"""

from __future__ import annotations

import copy
import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open

from dpocache.cache.build import BuildOptions, build_missing, default_cache_dir, namespace_for_dir
from dpocache.cache.store import CacheStore
from dpocache.config import ConfigError, validate_device, whole_number
from dpocache.data.columns import PairsView, TokenColumns
from dpocache.data.pairs import TokenizedPair, example_key, unfit_pairs
from dpocache.integrations.trl_signals import train_until_signal
from dpocache.models.directories import reference_source
from dpocache.models.loading import checkpoint_files
from dpocache.models.reference import DTYPES, ReferenceModel, default_device, dtype_name, resolve_dtype
from dpocache.runtime.preflight import model_context, model_vocab_size

SUPPORTED_TRL = ("1.16.",)  # versions whose DPOTrainer internals this subclass was checked against

try:
    import trl
    from trl import DPOTrainer
except ImportError as e:  # the extra is optional; say how to get it
    raise ImportError("dpocache.integrations.trl needs TRL 1.16: pip install 'dpocache[trl]' "
                      "(in a clone of dpocache: pip install -e '.[trl]')") from e


def check_trl_internals(subclass: str, trainer: type, hooks: tuple[str, ...], version: str | None = None) -> None:
    """Raise ``RuntimeError`` naming the versions supported when TRL's internals that ``subclass``
    overrides (``trainer``'s ``hooks``) may differ from those it was checked against."""
    version = version or trl.__version__
    if not version.startswith(SUPPORTED_TRL) or not all(hasattr(trainer, h) for h in hooks):
        raise RuntimeError(f"{subclass} supports TRL {', '.join(v + 'x' for v in SUPPORTED_TRL)}; found TRL "
                           f"{version}, whose {trainer.__name__} internals may differ (pip install 'dpocache[trl]'; "
                           "in a clone of dpocache: pip install -e '.[trl]')")


def check_trl_version(version: str | None = None) -> None:
    """``check_trl_internals`` for ``CachedDPOTrainer``."""
    check_trl_internals("CachedDPOTrainer", DPOTrainer, ("_precompute_ref_logps",), version)


log = logging.getLogger(__name__)

# Values read per tensor by the weight check: rows at the start, middle and end of dim 0, each up
# to _SPAN values of the last dim. Any training step, merged adapter or resize changes most values
# of the tensors it touches, so a few per tensor find it, at a cost independent of the model's size.
_SPAN = 4096


def _reference_dir(path: str | Path | None, source: str) -> Path:
    """``path`` (which came from ``source``) as a local directory; ``ValueError`` if it is not one."""
    if not path or not Path(path).expanduser().is_dir():
        raise ValueError(f"CachedDPOTrainer needs the reference as a local model directory; {source} is {path!r} "
                         "(pass cache_reference= the directory, or a model loaded with from_pretrained from one)")
    return Path(path).expanduser()


def _sample_index(shape: tuple[int, ...]) -> Iterator[tuple[slice, ...]]:
    """Index tuples reading a few values of a tensor of ``shape`` (see ``_SPAN``)."""
    if len(shape) == 0 or 0 in shape:
        yield ()
        return
    if len(shape) == 1:
        yield (slice(0, min(shape[0], _SPAN)),)
        return
    for row in sorted({0, shape[0] // 2, shape[0] - 1}):
        yield (slice(row, row + 1), *(slice(d // 2, d // 2 + 1) for d in shape[1:-1]), slice(0, min(shape[-1], _SPAN)))


def _file_tensors(path: Path) -> Iterator[tuple[str, tuple[int, ...], Callable[[tuple], torch.Tensor]]]:
    """(name, shape, read(index)) of each tensor in a checkpoint file, memory-mapped: only the values
    read are loaded."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                yield name, tuple(part.get_shape()), (lambda i, n=name, s=part: s[i] if i else f.get_tensor(n))
    else:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # a legacy (pre-zipfile) .bin cannot be memory-mapped: not compared (warned)
            return
        for name, t in state.items():
            yield name, tuple(t.shape), (lambda i, t=t: t[i])


def _differs(files: list[Path], tensors: dict[str, torch.Tensor]) -> tuple[str | None, int]:
    """(the first tensor of ``files`` whose sampled values differ from ``tensors``' under the same
    name, or None; how many were compared). Compared exactly in the module's dtype, as loading
    casts; tensors the module does not hold, or holds quantized, are not compared."""
    compared = 0
    for path in files:
        for name, shape, read in _file_tensors(path):
            mine = tensors.get(name)
            if mine is None or not mine.dtype.is_floating_point or mine.device.type == "meta":
                continue
            if tuple(mine.shape) != shape:
                return name, compared + 1
            for index in _sample_index(shape):
                if not torch.equal(read(index).to(mine.dtype), mine[index].detach().cpu()):
                    return name, compared + 1
            compared += 1
    return None, compared


def _adapter_names(module: Any) -> set[str]:
    return set(getattr(module, "peft_config", None) or {})


def _base_tensors(module: Any) -> dict[str, torch.Tensor]:
    """The base model's tensors of ``module`` under the names its checkpoint uses: PEFT's
    wrapper and its ``base_layer`` / ``original_module`` segments removed, adapter tensors left out."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    adapters = _adapter_names(module) | _adapter_names(base)
    out = {}
    for name, t in base.state_dict(keep_vars=True).items():
        parts = name.split(".")
        if adapters & set(parts):
            continue  # lora_A.default.weight, modules_to_save.default.weight, ...: the adapter's
        out[".".join(p for p in parts if p not in ("base_layer", "original_module"))] = t
    return out


def _trained_adapter(module: Any) -> str | None:
    """A tensor of ``module``'s PEFT adapter that makes its outputs differ from its base's; None
    when it has none, or only LoRA pairs with A or B all zero (PEFT's fresh init)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    adapters = _adapter_names(module) | _adapter_names(base)
    if not adapters:
        return None
    state = base.state_dict(keep_vars=True)
    pairs: dict[str, list[bool]] = {}
    for name, t in state.items():
        parts = name.split(".")
        if not adapters & set(parts):
            continue
        kind = next((p for p in parts if p.startswith("lora_")), None)
        if kind in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            pairs.setdefault(name.replace(kind, "lora_*"), []).append(not t.detach().any().item())
        elif kind == "lora_magnitude_vector":
            continue  # DoRA's magnitude starts as the weight's norm: no change while a pair is zero
        elif "modules_to_save" in parts:
            original = state.get(".".join(parts[:parts.index("modules_to_save")] + ["original_module"]
                                          + parts[parts.index("modules_to_save") + 2:]))
            if original is None or not torch.equal(original.detach(), t.detach()):
                return name
        else:
            return name  # another PEFT method's tensor: not known to start as the identity
    return next((name for name, zero in pairs.items() if not any(zero)), None)


def check_reference_weights(module: Any, path: Path, what: str, given: bool) -> None:
    """Raise ``ValueError`` (one line saying what to pass) unless the reference dpocache computes
    from ``path`` is ``module``, TRL's reference: its base weights are those of the files, and
    its PEFT adapter (if any) is fresh or, for an adapter directory, the one saved there.
    ``what``: the argument ``module`` came in; ``given``: ``path`` is ``cache_reference``."""
    base, adapter = reference_source(path)
    source = "cache_reference" if given else f"{what}.name_or_path"
    tensors = _base_tensors(module)
    files = checkpoint_files(base, "model")
    name, compared = _differs(files, tensors)
    if name is not None:
        raise ValueError(f"CachedDPOTrainer: {what}'s weights differ from those in {base} ({source}), which the "
                         f"cached reference is computed from (first: {name}). If {what} was changed after loading "
                         "(training, merge_and_unload, edits), save_pretrained it and load it from that directory; "
                         "for a reference that differs from the policy on purpose (a trained model against its SFT "
                         "model), pass TRL's ref_model= (loaded) and cache_reference= its directory")
    if not compared:  # an unknown layout (renamed or fused tensors): say so rather than pass silently
        log.warning("CachedDPOTrainer: no tensor of %s matched one in %s by name and shape; %s's weights could not "
                    "be checked against the reference's", what, base, what)
    if adapter is None:
        trained = _trained_adapter(module)
        if trained is not None:
            raise ValueError(f"CachedDPOTrainer: {what} carries a trained PEFT adapter ({trained} is not zero), so "
                             f"TRL's reference is its base with that adapter on, not {base} ({source}); pass "
                             "cache_reference= the adapter directory it was loaded from (save_pretrained it first "
                             "if it changed since)")
        return
    if not hasattr(module, "get_base_model") or "default" not in _adapter_names(module):
        raise ValueError(f"CachedDPOTrainer: cache_reference {path} is a PEFT adapter directory but {what} is not a "
                         f"PeftModel with that adapter; load it with AutoPeftModelForCausalLM.from_pretrained("
                         f"'{path}', is_trainable=True), or pass a full model directory")
    from peft import get_peft_model_state_dict

    name, compared = _differs(checkpoint_files(adapter, "adapter_model"),
                              get_peft_model_state_dict(module, adapter_name="default"))
    if name is not None or not compared:
        raise ValueError(f"CachedDPOTrainer: {what}'s adapter differs from the one in {adapter} (cache_reference; "
                         f"{f'first: {name}' if name else 'no tensor in common'}); save_pretrained the adapter and "
                         "pass that directory as cache_reference")


def truncated_ids(index: int, prompt: list[int], chosen: list[int], rejected: list[int], max_length: int | None,
                  truncation_mode: str) -> tuple[list[int], list[int], list[int]]:
    """The (prompt, chosen, rejected) ids TRL's collator (``DataCollatorForPreference``) scores:
    prompt + completion cut to ``max_length`` tokens. ``keep_start`` cuts the completion's end;
    ``keep_end`` is supported when nothing needs cutting (it would give chosen and rejected
    different prompts)."""
    if max_length is not None and max(len(prompt) + len(chosen), len(prompt) + len(rejected)) > max_length:
        if truncation_mode != "keep_start":
            raise ValueError(f"CachedDPOTrainer: row {index} exceeds max_length={max_length}; only "
                             "truncation_mode='keep_start' is supported for rows that need truncation")
        prompt = prompt[:max_length]
        keep = max(0, max_length - len(prompt))
        chosen, rejected = chosen[:keep], rejected[:keep]
    return prompt, chosen, rejected


def truncated_pair(index: int, prompt: list[int], chosen: list[int], rejected: list[int], max_length: int | None,
                   truncation_mode: str) -> TokenizedPair:
    """``truncated_ids`` as a ``TokenizedPair``."""
    prompt, chosen, rejected = truncated_ids(index, prompt, chosen, rejected, max_length, truncation_mode)
    return TokenizedPair(index, tuple(prompt), tuple(chosen), tuple(rejected), example_key(prompt, chosen, rejected))


ROWS_PER_CHUNK = 8192  # rows of TRL's dataset read at a time: their ids are Python lists until they become columns


def dataset_pairs(dataset, max_length: int | None, truncation_mode: str) -> PairsView:
    """The pairs of TRL's tokenized ``dataset`` (``prompt_ids``, ``chosen_ids``, ``rejected_ids``
    columns) as TRL scores them, held as columns of integers (``dpocache.data.columns``), read
    a chunk of rows at a time: not as tuples of Python ints, a hundred bytes a token."""
    cols = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    parts = []
    for start in range(0, len(cols), ROWS_PER_CHUNK):
        chunk = cols[start:start + ROWS_PER_CHUNK]
        triples = [truncated_ids(start + i, p, c, r, max_length, truncation_mode)
                   for i, (p, c, r) in enumerate(zip(chunk["prompt_ids"], chunk["chosen_ids"], chunk["rejected_ids"]))]
        rows = range(start, start + len(triples))
        parts.append(TokenColumns.from_pairs(triples, rows, rows, [False] * len(triples)))
    return PairsView(TokenColumns.concatenate(parts))


def named_datasets(train_dataset: Any, eval_dataset: Any) -> dict[str, Any]:
    """A trainer's data sets by the name a message gives them: ``train_dataset``, and
    ``eval_dataset`` or, for a dict of them, ``eval_dataset['NAME']`` each (values may be None)."""
    if isinstance(eval_dataset, dict):
        return {"train_dataset": train_dataset, **{f"eval_dataset[{k!r}]": v for k, v in eval_dataset.items()}}
    return {"train_dataset": train_dataset, "eval_dataset": eval_dataset}


def _check_fixed_reference_data(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """What a cache of a fixed reference's values over a data set known in advance cannot serve,
    in dpocache's words (TRL's own refusals name ``precompute_ref_log_probs``, which this trainer
    sets itself), before any model loads."""
    if getattr(args, "sync_ref_model", False):
        raise ValueError("CachedDPOTrainer: sync_ref_model=True would copy the policy into the reference during "
                         "training (TR-DPO); dpocache's reference is fixed (use DPOTrainer for a synced reference)")
    for name, dataset in named_datasets(train_dataset, eval_dataset).items():
        if dataset is None:
            continue
        if not hasattr(dataset, "__len__"):
            raise ValueError(f"CachedDPOTrainer: {name} is an {type(dataset).__name__}, whose pairs cannot be keyed "
                             "before training; load it as a map-style Dataset (datasets.load_dataset(..., "
                             "streaming=False))")
        columns = getattr(dataset, "column_names", None) or ()
        if "image" in columns or "images" in columns:
            raise ValueError(f"CachedDPOTrainer: {name} has images; the reference cache scores text only (use "
                             "DPOTrainer for a vision-language model)")
        _check_prompt_kind(name, dataset, columns)


def _check_prompt_kind(name: str, dataset: Any, columns: Sequence[str]) -> None:
    """A text prompt beside conversations that hold it (Tulu 3's preference mixtures): TRL 1.16's
    DPOTrainer extracts a prompt only from rows without one, and stopped on these with "can only
    concatenate str (not "list") to str" deep in its tokenization."""
    if not {"prompt", "chosen"} <= set(columns) or not len(dataset):
        return
    row = dataset[0]
    if isinstance(row["prompt"], str) and isinstance(row["chosen"], list):
        raise ValueError(f"CachedDPOTrainer: {name} gives the prompt as text and chosen as messages (as Tulu 3's "
                         "preference mixtures do), which TRL's DPOTrainer cannot tokenize; take the prompt from the "
                         f"messages first: {name}.map(trl.maybe_extract_prompt)")


def _check_cache_options(dtype: Any, device: Any, max_tokens: Any) -> None:
    """This trainer's own arguments, each named, before any model loads: a device this machine
    lacks failed deep in torch once a value had to be computed."""
    if dtype is not None and dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"CachedDPOTrainer: cache_dtype must be one of auto, {', '.join(DTYPES)} (None: the "
                         f"precision of args); got {dtype!r}")
    if max_tokens is not None and not whole_number(max_tokens, 1):
        raise ValueError(f"CachedDPOTrainer: cache_max_tokens must be a whole number of at least 1; "
                         f"got {max_tokens!r}")
    try:
        validate_device(device, "cache_device")
    except ConfigError as e:
        raise ValueError(f"CachedDPOTrainer: {e}") from None


class CachedDPOTrainer(DPOTrainer):
    """``DPOTrainer`` whose reference values come from dpocache's cache.

    Args (beyond ``DPOTrainer``'s):
        cache_reference: the directory dpocache computes the reference from: a full model
            directory, or a PEFT adapter directory (its base with that adapter on). Default: the
            directory ``ref_model`` (or ``model``) was loaded from. Checked against that module.
        cache_dir: the cache root (default: ``$DPOCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpocache``, else
            ``~/.cache/dpocache``).
        cache_dtype: dtype of the reference pass: ``float32``, ``bfloat16``, ``float16`` or
            ``auto``; it is part of the cache namespace. Default: the precision of ``args``
            (``bf16`` → ``bfloat16``, ``fp16`` → ``float16``, else ``float32``), which TRL's own
            reference forwards run in (autocast), so step-0 log-ratios are 0; another one is
            warned about.
        cache_max_tokens: padded tokens per reference forward when building missing values
            (default by device: ``cache.build.default_max_tokens``).
        cache_device: device of the reference pass (default: CUDA if available).
    """

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, *, cache_dir: str | Path | None = None,
                 cache_dtype: str | None = None, cache_max_tokens: int | None = None,
                 cache_device: str | None = None, cache_reference: str | Path | None = None, **kwargs: Any):
        check_trl_version()
        if args is None:
            raise ValueError("CachedDPOTrainer needs args=DPOConfig(...)")
        if getattr(args, "ld_alpha", None) is not None:
            raise ValueError("CachedDPOTrainer does not support ld_alpha yet (TRL folds it into the reference sums)")
        _check_fixed_reference_data(args, kwargs.get("train_dataset"), kwargs.get("eval_dataset"))
        _check_cache_options(cache_dtype, cache_device, cache_max_tokens)
        if isinstance(ref_model, (str, Path)):
            raise ValueError("CachedDPOTrainer: ref_model must be a loaded model (TRL 1.16 loads none from a path); "
                             "pass the reference's directory as cache_reference=")
        if ref_model is None and isinstance(model, (str, Path)):
            # TRL loads the policy from this directory itself, so its reference is that directory's weights.
            model = str(model)  # TRL tells a path from a model by isinstance(model, str)
            if cache_reference is not None and Path(cache_reference).resolve() != Path(model).resolve():
                raise ValueError(f"CachedDPOTrainer: cache_reference {cache_reference} is not the directory model "
                                 f"is loaded from ({model}), which is TRL's reference; leave cache_reference unset")
            self._ref_path = _reference_dir(model, "model")
        else:
            # TRL's reference is ref_model, or the policy as passed: the cache must be of that module.
            what, module = ("ref_model", ref_model) if ref_model is not None else ("model", model)
            given = cache_reference if cache_reference is not None else getattr(module, "name_or_path", None)
            self._ref_path = _reference_dir(given, "cache_reference" if cache_reference is not None
                                            else f"{what}.name_or_path")
            check_reference_weights(module, self._ref_path, what, given=cache_reference is not None)
        self._cache_device = torch.device(cache_device) if cache_device else default_device()
        self._cache_dtype = self._resolve_cache_dtype(cache_dtype, args)
        self._cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self._cache_max_tokens = cache_max_tokens
        self.cache_summaries: dict[str, Any] = {}  # dataset name -> dpocache BuildSummary
        # On a copy: the caller's config may be reused for a stock DPOTrainer, which would then
        # precompute. Shallow: TRL reads the fields, and this sets one.
        args = copy.copy(args)
        args.precompute_ref_log_probs = True  # TRL then reads the columns and keeps no reference forward
        super().__init__(model, ref_model, args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``DPOTrainer.train``; a stop signal ends it at a saved step (``trl_signals``)."""
        return train_until_signal(self, super().train, *args, **kwargs)

    def _resolve_cache_dtype(self, cache_dtype: str | None, args: Any) -> torch.dtype:
        """``cache_dtype``, by default the precision of ``args``. TRL 1.16 runs its reference
        forwards, as the policy's, under ``accelerator.autocast()``: bf16 / fp16 autocast over the
        model's weights, which is what dpocache's bfloat16 / float16 reference pass is, so only
        that dtype gives the same values (measured: 8e-6 against 7e-3 nats with float32)."""
        precision = "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) \
            else "float32"
        dtype = resolve_dtype(cache_dtype or precision, self._cache_device)
        if dtype != DTYPES[precision]:
            log.warning("CachedDPOTrainer: cache_dtype=%r computes the reference in %s, but args (bf16=%s, fp16=%s) "
                        "run TRL's forwards in %s, so step-0 log-ratios are not 0; leave cache_dtype unset to follow "
                        "args", cache_dtype, dtype_name(dtype), getattr(args, "bf16", False),
                        getattr(args, "fp16", False), precision)
        return dtype

    def _load_reference(self) -> ReferenceModel:
        """The reference ``cache_reference`` describes (an adapter directory: its base, adapter on)."""
        base, adapter = reference_source(self._ref_path)
        # The model's own kernels, as TRL's policy runs: Liger's patches reach past the reference
        # (its RoPE replaces the module's function for the whole process, the policy's included).
        return ReferenceModel.from_pretrained(base, self._cache_dtype, self._cache_device, adapter=adapter,
                                              kernels="none")

    def _report(self, name: str, summary) -> None:
        """Where the reference values of data set ``name`` came from, in the CLI's words: once, on
        stderr (the main process) and through the logger."""
        line = (f"reference ({name}): {summary.unique} pairs from the cache ({summary.computed} computed, "
                f"{summary.reused} reused) in {summary.cache_dir}")
        log.info("CachedDPOTrainer: %s", line)
        if getattr(getattr(self, "accelerator", None), "is_main_process", True):
            print(line, file=sys.stderr)

    def _check_fit(self, name: str, pairs: PairsView) -> None:
        """Pairs the reference cannot take, refused in one line before it loads, as ``dpocache
        train`` refuses them: a token id past its vocabulary (an IndexError in the forward, a device
        assert on a GPU) or a pair longer than its context after TRL's truncation (positions the
        model never saw, which TRL's own reference would score without a word). The row is TRL's
        (it drops the pairs its truncation empties), so the line shows the prompt's start too."""
        base, _ = reference_source(self._ref_path)
        for problem in unfit_pairs(pairs.columns, model_vocab_size(base), model_context(base), self.args.max_length,
                                   max_length_option="args.max_length to"):
            found = list(problem)
            if found:
                row, reason = found[0]
                tokenizer = getattr(self, "_tokenizer", None) or self.processing_class
                start = tokenizer.decode(pairs[row].prompt_ids[:24], skip_special_tokens=True)
                more = f" ({len(found)} rows in all)" if len(found) > 1 else ""
                raise ValueError(f"CachedDPOTrainer: {name} dataset row {row} as TRL tokenized it (prompt "
                                 f"{start[:40]!r}...): {reason}{more}")

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """Fill ``ref_chosen_logps`` / ``ref_rejected_logps`` from the cache (TRL's hook)."""
        pairs = dataset_pairs(dataset, self.args.max_length, self.args.truncation_mode)
        self._check_fit(name, pairs)
        store = CacheStore(self._cache_root, namespace_for_dir(self._ref_path, self._cache_dtype, self._cache_root))
        store.open(repair=True)  # bad shards quarantined, a killed build's shards adopted (as `cache build`)
        tokenizer = getattr(self, "_tokenizer", None) or self.processing_class
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        options = BuildOptions(pad_id=pad_id, max_tokens=self._cache_max_tokens, show_progress=False)
        summary = self.cache_summaries[name] = build_missing(store, pairs, self._load_reference, options)
        self._report(name, summary)
        values = store.lookup(pairs.keys())
        dataset = dataset.remove_columns([c for c in ("ref_chosen_logps", "ref_rejected_logps")
                                          if c in dataset.column_names])
        dataset = dataset.add_column("ref_chosen_logps", values.chosen_logps.float().tolist())
        return dataset.add_column("ref_rejected_logps", values.rejected_logps.float().tolist())


def __getattr__(name: str):
    """``CachedGRPOTrainer`` (``dpocache.integrations.trl_grpo``), imported on first use: that
    module imports this one, so importing it here at the top would be a cycle."""
    if name == "CachedGRPOTrainer":
        return importlib.import_module("dpocache.integrations.trl_grpo").CachedGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
