"""The reference values a run trains against: read from the cache, what is missing built first
(the reference model freed before the policy loads); the step-0 audit that checks them against
the policy's first forward when the policy starts from the reference's weights."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from dpocache.cache import CacheStore, default_cache_dir, namespace_for_dir
from dpocache.cache.store import LEFT_AS_IT_IS
from dpocache.cache.build import BuildOptions, build_distributed
from dpocache.cache.fingerprint import default_memo_path
from dpocache.cache.probes import ProbeMemo
from dpocache.config import Config
from dpocache.data.pairs import PreferenceData, TokenizedPair
from dpocache.distributed.process_group import (
    DistEnv,
)
from dpocache.distributed.sharded_reference import reference_loader
from dpocache.losses.ld_dpo import ld_values
from dpocache.models.directories import adapter_base_dir, reference_source
from dpocache.models.reference import dtype_name
from dpocache.runtime.preflight import unwritable
from dpocache.training import audit
from dpocache.training.resume import ResumedFrom
from dpocache.training.state import Run, write_run_json


def cache_dir_of(cfg: Config) -> Path:
    return Path(cfg.cache.dir) if cfg.cache.dir else default_cache_dir()


def prepare_reference(cfg: Config, env: DistEnv, dtype: torch.dtype, spec, tokenizer, train_data: PreferenceData,
                      eval_data: PreferenceData | None, resumed_from: ResumedFrom | None = None,
                      compiled_policy: bool = False):
    """Reference sums for every pair, from the cache; builds what is missing first, then frees
    the reference model. A resumed run's reference must hash as its checkpoint's did (checked
    before any build). ``compiled_policy``: the policy's layers are compiled in this process, so
    the reference takes no Liger RoPE (``dpocache.models.kernels``). Returns (train values, eval
    values, report for run.json)."""
    if not spec.needs_reference:
        return None, None, {"source": "none (reference-free loss)", "forward_passes_during_training": 0}
    ref_path = cfg.model.ref_model or cfg.model.path
    ref_dir, adapter = reference_source(ref_path, cfg.model.reference)
    cache_dir = cache_dir_of(cfg)
    store = CacheStore(cache_dir, namespace_for_dir(ref_path, dtype, cache_dir, cfg.model.reference,
                                                    read_only=unwritable(cache_dir) is not None))
    if resumed_from is not None:
        resumed_from.check_namespace(cfg, store.namespace.id)
    pairs = train_data.pairs + (eval_data.pairs if eval_data else [])
    load = reference_loader(ref_dir, dtype, env, cfg.cache.layout, sharded=cfg.distributed.fsdp, adapter=adapter,
                            attention=cfg.model.attention, probe_memo=ProbeMemo(cache_dir), compile=cfg.model.compile,
                            kernels=cfg.model.kernels, stream=cfg.model.stream_reference,
                            liger_rope=not compiled_policy)
    # Every rank scores its token-balanced share of what is missing (one rank: all of it).
    options = BuildOptions(pad_id=tokenizer.pad_token_id or 0, max_tokens=cfg.cache.max_tokens,
                           shard_pairs=cfg.cache.shard_size, show_progress=cfg.train.progress and env.is_main,
                           per_token=cfg.loss.ld_alpha is not None, sharded=cfg.distributed.fsdp)  # per token: LD-DPO
    summary = build_distributed(store, pairs, load, env, options)
    if env.is_main:
        # A cache this user cannot write was read as it is: a bad shard's pairs were read from
        # others, or refused, never recomputed into it.
        action = LEFT_AS_IT_IS if store.repair_skipped else "recomputing its pairs"
        for bad in summary.corrupt_shards:
            print(store.describe_corrupt(bad, action, repaired=not store.repair_skipped), file=sys.stderr)
    if summary.computed:
        gc.collect()  # the reference model is unreachable now; give its memory back
    if not env.is_main:
        store.open()  # rank 0's store already holds every rank's new shards
    ld = cfg.loss.ld_alpha is not None  # LD-DPO: the sums are recombined from the cached per-token values
    train_vals = store.lookup([p.key for p in train_data.pairs], per_token=ld)
    eval_vals = store.lookup([p.key for p in eval_data.pairs], per_token=ld) if eval_data else None
    info = {
        "source": "cache", "cache_dir": str(store.dir), "namespace": store.namespace.id,
        "model": store.namespace.model,
        "reference": cfg.model.reference,
        "dtype": dtype_name(dtype), "pairs": len(set(p.key for p in pairs)),
        "computed": summary.computed, "reused": summary.reused, "built_on_ranks": summary.world_size,
        # The build's own count (its summary), all before the first step. The loop holds no
        # reference model: the build's is unreachable once it returns (freed above).
        "forward_passes": summary.forward_passes, "forward_passes_during_training": 0,
        "kernels": summary.kernels,  # the build's (dpocache.models.kernels); None when every pair was cached
        "streamed": summary.streamed,  # its layers streamed from host memory (dpocache.models.streaming), or None
    }
    if ld:
        train_vals = ld_values(train_vals, cfg.loss.ld_alpha)
        eval_vals = ld_values(eval_vals, cfg.loss.ld_alpha) if eval_data else None
        return train_vals, eval_vals, {**info, "ld_alpha": cfg.loss.ld_alpha}
    return train_vals, eval_vals, info


def plan_audit(run: Run) -> bool:
    """Whether the first micro-batch audits the cache: only when the policy starts from the
    reference's own weights (the same on every rank: it depends on the config and the step)."""
    cfg, reason = run.cfg, None
    ref_path = cfg.model.ref_model or cfg.model.path
    if run.ref_train is None:
        reason = "no cached reference (reference-free loss)"
    elif run.step > 0:
        if "step0_audit" in run.info["reference"]:
            return False  # the record of the attempt that ran step 0, from the checkpoint (resume)
        reason = f"resumed at step {run.step}: the policy is no longer the reference"
    elif Path(ref_path).resolve() != Path(cfg.model.path).resolve():
        reason = "the reference (--ref-model) is another model than the policy"
    elif cfg.model.reference == "base" and adapter_base_dir(cfg.model.path) is not None:
        reason = "--reference base: the reference is the adapter's bare base, the policy starts with the adapter on"
    elif cfg.lora.dropout > 0 and adapter_base_dir(cfg.model.path) is not None:
        # a fresh adapter adds 0 whatever its dropout; a trained one does not, so its training forward is random
        reason = "--lora.dropout on a loaded adapter: the policy's training forward is not the reference's"
    if reason is not None:
        run.info["reference"]["step0_audit"] = {"skipped": reason}
    return reason is None


def audit_step0(run: Run, pairs: list[TokenizedPair], policy_c: torch.Tensor, policy_r: torch.Tensor,
                ref_c: torch.Tensor, ref_r: torch.Tensor) -> None:
    """The first micro-batch's policy log-probs ``(B,)`` are reference log-probs: compare them with
    the cached values ``(B,)`` (``dpocache.training.audit``), record the drift in run.json, stop if it is
    too large. Both sides are the loss's inputs (LD-DPO's weighted sums when ``ld_alpha`` is set:
    the same weighting of the same per-token values)."""
    dtype = dtype_name(run.dtype)
    result = audit.gather(run.env, audit.compare(pairs, policy_c, policy_r, ref_c, ref_r, dtype))
    ok = result["over"] == 0
    run.info["reference"]["step0_audit"] = {
        "ok": ok, "sequences": result["sequences"], "ranks": result["ranks"], "max_abs_drift": result["max_abs_drift"],
        "max_drift_over_tolerance": result["max_drift_over_tolerance"], "tolerance": audit.tolerance_text(dtype),
        **({"worst": result["worst"]} if not ok else {}),
    }
    run.audit_step0 = False
    if not ok:
        write_run_json(run)
        ns_dir = run.info["reference"]["cache_dir"]
        rebuild = _rebuild_command(run.cfg, ns_dir, dtype)
        raise audit.ReferenceAuditFailed(audit.failure_message(result, ns_dir, rebuild))


def _rebuild_command(cfg: Config, ns_dir: str, dtype: str) -> str:
    """Shell commands that drop the namespace (and the weight-hash memo, in case a weight file
    changed under the same mtime) and build it again."""
    cache_root = Path(ns_dir).parent
    parts = [f"rm -r {ns_dir} {default_memo_path(cache_root)} && dpocache cache build",
             f"--model {cfg.model.ref_model or cfg.model.path}", f"--data {cfg.data.train}",
             f"--cache-dir {cache_root}",
             f"--dtype {dtype}",
             f"--layout {cfg.cache.layout}"]
    if cfg.data.max_length is not None:
        parts.append(f"--max-length {cfg.data.max_length}")
    if cfg.data.max_prompt_length is not None:
        parts.append(f"--max-prompt-length {cfg.data.max_prompt_length}")
    if cfg.model.reference != "initial":
        parts.append(f"--reference {cfg.model.reference}")
    again = "run this training again, which builds what is missing"
    return " ".join(parts) + (f" (and the same for --eval-data), or {again}" if cfg.data.eval else f" (or {again})")
