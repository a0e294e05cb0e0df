"""``CachedDPOTrainer``: TRL's ``DPOTrainer`` with its reference values from dpocache's cache.

TRL reads precomputed reference values from the dataset columns ``ref_chosen_logps`` and
``ref_rejected_logps`` when ``precompute_ref_log_probs`` is set, and then runs no reference
forward while training. This subclass fills those columns from dpocache's content-addressed
cache instead of TRL's own precompute pass: each pair is keyed by its token ids (after TRL's
tokenization and the collator's truncation), so a second run with shuffled, extended or
re-split data reuses every value, and only missing pairs are scored, by dpocache's engine.

The reference is the model directory of ``ref_model`` (or of ``model`` when there is none):
the weights on disk, fingerprinted by dpocache, as TRL's own reference is the initial policy.

Needs ``pip install 'dpocache[trl]'`` (TRL 1.16); other TRL versions fail at construction with
one message, since this overrides TRL internals (``_precompute_ref_logps``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..cache.build import (build_missing, default_cache_dir, namespace_for_dir,
                           reference_weights_dir)
from ..cache.store import CacheStore
from ..data import TokenizedPair, example_key
from ..reference import ReferenceModel, default_device, resolve_dtype

SUPPORTED_TRL = ("1.16.",)  # versions whose DPOTrainer internals this subclass was checked against

try:
    import trl
    from trl import DPOTrainer
except ImportError as e:  # the extra is optional; say how to get it
    raise ImportError("dpocache.integrations.trl needs TRL: pip install 'dpocache[trl]'") from e


def check_trl_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` naming the versions supported when TRL's internals may differ."""
    version = version or trl.__version__
    if not version.startswith(SUPPORTED_TRL) or not hasattr(DPOTrainer, "_precompute_ref_logps"):
        raise RuntimeError(f"CachedDPOTrainer supports TRL {', '.join(v + 'x' for v in SUPPORTED_TRL)}; found TRL "
                           f"{version}, whose DPOTrainer internals may differ (pip install 'dpocache[trl]')")


def _model_dir(model: Any) -> Path:
    """The directory a model (or a path to one) was loaded from."""
    path = model if isinstance(model, (str, Path)) else getattr(model, "name_or_path", None)
    if not path or not Path(path).exists():
        raise ValueError(f"CachedDPOTrainer needs the reference as a local model directory; got {path!r} "
                         "(pass ref_model=, or a model loaded with from_pretrained from a directory)")
    return reference_weights_dir(path)


def truncated_pair(index: int, prompt: list[int], chosen: list[int], rejected: list[int], max_length: int | None,
                   truncation_mode: str) -> TokenizedPair:
    """The pair TRL's collator (``DataCollatorForPreference``) scores: prompt + completion cut to
    ``max_length`` tokens. ``keep_start`` cuts the completion's end; ``keep_end`` is supported
    when nothing needs cutting (it would give chosen and rejected different prompts)."""
    if max_length is not None and max(len(prompt) + len(chosen), len(prompt) + len(rejected)) > max_length:
        if truncation_mode != "keep_start":
            raise ValueError(f"CachedDPOTrainer: row {index} exceeds max_length={max_length}; only "
                             "truncation_mode='keep_start' is supported for rows that need truncation")
        prompt = prompt[:max_length]
        keep = max(0, max_length - len(prompt))
        chosen, rejected = chosen[:keep], rejected[:keep]
    return TokenizedPair(index, tuple(prompt), tuple(chosen), tuple(rejected), example_key(prompt, chosen, rejected))


class CachedDPOTrainer(DPOTrainer):
    """``DPOTrainer`` whose reference values come from dpocache's cache.

    Args (beyond ``DPOTrainer``'s):
        cache_dir: the cache root (default: ``$DPOCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpocache``, else
            ``~/.cache/dpocache``).
        cache_dtype: dtype of the reference pass: ``float32`` (default), ``bfloat16`` or ``auto``;
            it is part of the cache namespace.
        cache_max_tokens: padded tokens per reference forward when building missing values
            (default by device: ``cache.build.default_max_tokens``).
        cache_device: device of the reference pass (default: CUDA if available).
    """

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, *, cache_dir: str | Path | None = None,
                 cache_dtype: str = "float32", cache_max_tokens: int | None = None,
                 cache_device: str | None = None, **kwargs: Any):
        check_trl_version()
        if args is None:
            raise ValueError("CachedDPOTrainer needs args=DPOConfig(...)")
        if getattr(args, "ld_alpha", None) is not None:
            raise ValueError("CachedDPOTrainer does not support ld_alpha yet (TRL folds it into the reference sums)")
        self._ref_dir = _model_dir(ref_model if ref_model is not None else model)
        self._cache_device = torch.device(cache_device) if cache_device else default_device()
        self._cache_dtype = resolve_dtype(cache_dtype, self._cache_device)
        self._cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self._cache_max_tokens = cache_max_tokens
        self.cache_summaries: dict[str, Any] = {}  # dataset name -> dpocache BuildSummary
        args.precompute_ref_log_probs = True  # TRL then reads the columns and keeps no reference forward
        super().__init__(model, ref_model, args, **kwargs)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """Fill ``ref_chosen_logps`` / ``ref_rejected_logps`` from the cache (TRL's hook)."""
        cols = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
        pairs = [truncated_pair(i, row["prompt_ids"], row["chosen_ids"], row["rejected_ids"], self.args.max_length,
                                self.args.truncation_mode) for i, row in enumerate(cols)]
        store = CacheStore(self._cache_root, namespace_for_dir(self._ref_dir, self._cache_dtype, self._cache_root))
        store.open(repair=True)  # bad shards quarantined, a killed build's shards adopted (as `cache build`)
        tokenizer = getattr(self, "_tokenizer", None) or self.processing_class
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.cache_summaries[name] = build_missing(
            store, pairs, lambda: ReferenceModel.from_pretrained(self._ref_dir, self._cache_dtype, self._cache_device),
            pad_id=pad_id, max_tokens=self._cache_max_tokens, show_progress=False,
        )
        values = store.lookup([p.key for p in pairs])
        dataset = dataset.remove_columns([c for c in ("ref_chosen_logps", "ref_rejected_logps")
                                          if c in dataset.column_names])
        dataset = dataset.add_column("ref_chosen_logps", values.chosen_logps.float().tolist())
        return dataset.add_column("ref_rejected_logps", values.rejected_logps.float().tolist())
