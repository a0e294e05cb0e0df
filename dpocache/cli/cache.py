"""``dpocache cache build|info|verify|export``: argument handling and printing only; the work
is in ``dpocache.cache``."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from dpocache.cache import (
    CacheError,
    CacheStore,
    MissingReferenceError,
    default_cache_dir,
    namespace_for_dir,
    verify,
)
from dpocache.cache.build import (
    SAVED_AGAIN,
    BuildOptions,
    build_distributed,
    has_pair_values,
    namespace_dirs,
    open_namespace_dir,
    other_dtype_elsewhere,
    same_config_elsewhere,
)
from dpocache.cache.sequences import SUBDIR as SEQUENCES
from dpocache.cache.sequences import SequenceStore
from dpocache.cache.probes import ProbeMemo
from dpocache.cache.store import LEFT_AS_IT_IS, MANIFEST
from dpocache.cli.cache_args import OPTIONS
from dpocache.config import BOOL_WORDS
from dpocache.data.pairs import PreferenceData, load_preference_data
from dpocache.data.token_store import PARTIAL_PREFIX, token_stores
from dpocache.distributed.process_group import destroy, init_distributed
from dpocache.distributed.sharded_reference import reference_loader
from dpocache.losses.registry import parse_loss_spec
from dpocache.models.directories import reference_source
from dpocache.models.kernels import kernels_for
from dpocache.models.loading import load_tokenizer
from dpocache.models.reference import ReferenceModel, default_device, dtype_name, resolve_dtype
from dpocache.runtime.preflight import (
    UsageError,
    check_cache_dir,
    check_output,
    check_writable_dir,
    disk_errno,
    disk_errors,
    model_context,
    model_vocab_size,
    unwritable,
)
from dpocache.runtime.signals import Interrupted


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _load_data(args, tokenizer, verbose: bool = True, source: str | None = None) -> PreferenceData:
    cfg = args.cfg
    data = load_preference_data(source or args.data, tokenizer, args.max_length, args.max_prompt_length,
                                args.skip_invalid, show_progress=verbose, columns=cfg.data.columns(),
                                context=model_context(args.model), vocab_size=model_vocab_size(args.model),
                                cache_dir=args.cache_dir or default_cache_dir(),
                                # verify and export only read the cache; a build, one mounted read-only
                                cache_read_only=args.cache_command != "build" or cache_unwritable(args))
    if data.skipped and verbose:
        print(f"skipped {len(data.skipped)} invalid row{'s' if len(data.skipped) != 1 else ''}:", file=sys.stderr)
        for s in data.skipped[:20]:
            print(f"  {s}", file=sys.stderr)
        if len(data.skipped) > 20:
            print(f"  ... and {len(data.skipped) - 20} more", file=sys.stderr)
    return data


def cache_unwritable(args) -> bool:
    """The cache directory exists and cannot be written (a team's cache mounted read-only)."""
    return unwritable(args.cache_dir or default_cache_dir()) is not None


def _open_store(args, device, open_now: bool = True, verbose: bool = True) -> tuple[CacheStore, torch.dtype]:
    dtype = resolve_dtype(args.dtype, device)
    if args.dtype == "auto" and verbose:
        print(f"dtype: {dtype_name(dtype)} (auto, chosen for {device.type})", file=sys.stderr)
    cache_dir = args.cache_dir or default_cache_dir()
    reading = args.cache_command != "build" or cache_unwritable(args)  # verify and export only read the cache
    store = CacheStore(cache_dir, namespace_for_dir(args.model, dtype, cache_dir, args.reference, read_only=reading))
    store.rehash = args.cache_command == "verify"  # verify looks for damage: every shard hashed again, memo or not
    if open_now:
        store.open()
        for bad in store.corrupt:
            print(store.describe_corrupt(str(bad), "not loaded", repaired=False), file=sys.stderr)
    return store, dtype


def _load_reference(args, dtype, device) -> ReferenceModel:
    """``--model`` as the reference, whole in this process (``--reference``: an adapter directory
    with its adapter on, or its base)."""
    base, adapter = reference_source(args.model, args.reference)
    return ReferenceModel.from_pretrained(base, dtype, device, layout=args.layout, adapter=adapter,
                                          attention=args.attention, compile=args.compile, kernels=args.kernels,
                                          stream=args.stream_reference)


def cmd_build(args) -> int:
    """Under torchrun every rank scores its token-balanced share of the missing pairs
    (``build_distributed``); rank 0 prints the totals."""
    started = time.perf_counter()
    env = init_distributed(args.device)
    try:
        if env.is_main and not parse_loss_spec(args.cfg.loss.name, **args.cfg.loss.params()).needs_reference:
            print(f"note: the loss '{args.cfg.loss.name}' reads no reference: a training with it reads nothing of "
                  "this cache (other losses on the same model and data do)", file=sys.stderr)
        base, adapter = reference_source(args.model, args.reference)
        kernels_for(args.kernels, env.device, base)  # --kernels liger for a family Liger lacks: said before the data
        tokenizer = load_tokenizer(args.tokenizer)
        data = _load_data(args, tokenizer, verbose=env.is_main)
        pairs = data.pairs
        if args.eval_data:  # a config's eval set is cached too, as train would
            pairs = pairs + _load_data(args, tokenizer, verbose=env.is_main, source=args.eval_data).pairs
        data_s = time.perf_counter() - started  # the tokenizer, and the data tokenized or read from its token store
        store, dtype = _open_store(args, env.device, open_now=False, verbose=env.is_main)
        load = reference_loader(base, dtype, env, args.layout, sharded=args.fsdp, adapter=adapter,
                                attention=args.attention, probe_memo=ProbeMemo(store.root), compile=args.compile,
                                kernels=args.kernels, stream=args.stream_reference)
        options = BuildOptions(pad_id=tokenizer.pad_token_id or 0, per_token=args.per_token,
                               max_tokens=args.max_tokens, shard_pairs=args.shard_size, sharded=args.fsdp)
        try:
            summary = build_distributed(store, pairs, load, env, options)
        except Interrupted as stopped:
            if args.json and env.is_main and stopped.summary is not None:
                _print_json(stopped.summary, data)  # what was computed before the signal, its "interrupted" set
            raise
        if env.is_main:
            _print_build_summary(args, summary, store, dtype, data, (data_s, time.perf_counter() - started))
    finally:
        destroy(env)
    return 0


def _print_build_summary(args, s, store: CacheStore, dtype: torch.dtype, data: PreferenceData,
                         times: tuple[float, float]) -> None:
    """``times``: (seconds to the data loaded, seconds of the whole build), after the imports."""
    # With --json, stdout holds the JSON object alone (for jq, json.load), the lines go to stderr.
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)
    for bad in s.corrupt_shards:
        print(store.describe_corrupt(bad, LEFT_AS_IT_IS if store.repair_skipped else "not loaded",
                                     repaired=not store.repair_skipped), file=sys.stderr)
    ranks = f" on {s.world_size} ranks" if s.world_size > 1 else ""
    again = f" ({s.per_token_again} of them cached as sums alone: scored again for --per-token)" \
        if s.per_token_again else ""
    say(f"pairs {s.pairs} (unique {s.unique}): computed {s.computed}{ranks}{again}, reused {s.reused}")
    say(f"rows: {data.truncated} truncated to max_length={args.max_length}, {data.identical} with chosen == "
        f"rejected, {len(data.skipped)} skipped")
    # the tokens the forwards ran (the pairs computed, a prompt once); a token store counts every pair's
    say(f"reference pass: {s.tokens:,} tokens of the {s.computed:,} pairs computed in {s.seconds:.1f} s "
        f"({s.tokens_per_s:,.0f} tokens/s), peak memory {_human_bytes(s.peak_memory_bytes)}"
        + (" (largest rank)" if s.world_size > 1 else ""))
    say(f"cache {s.cache_dir} (dtype {dtype_name(dtype)}, {len(store)} pairs stored, "
        f"{_human_bytes(store.size_bytes())})")
    say(f"time: {times[1]:.1f} s after the imports: {times[0]:.1f} s loading the tokenizer and the data (tokenized, "
        f"or read from its token store), {s.seconds:.1f} s in the reference pass")
    if s.kernels and s.kernels["used"] == "liger":
        say(f"kernels: Liger's {', '.join(s.kernels['applied'])}")
    if s.streamed:
        say(f"streamed: {s.streamed['layers']} decoder layers from host memory ({s.streamed['host_gib']:.2f} GiB "
            f"page-locked) through {s.streamed['slots']} slots on the device ({s.streamed['device_gib']:.2f} GiB)")
        say(describe_transfers(s.streamed["transfers"]))
        pace = describe_pace(s.streamed["transfers"], s.seconds, training=False)
        if pace:
            say(pace)
    if args.json:
        _print_json(s, data, times)


def _print_json(s, data: PreferenceData, times: tuple[float, float] | None = None) -> None:
    out = s.to_json()
    out.update(skipped=len(data.skipped), truncated=data.truncated, identical=data.identical)
    if times is not None:
        out.update(data_s=round(times[0], 3), wall_s=round(times[1], 3))
    print(json.dumps(out), flush=True)


def describe_transfers(t: dict) -> str:
    """``copied 832 layers, 338.00 GiB at 52.1 GiB/s; the compute waited 0.21 s for them; the
    device had run dry at 12 of 832 layer starts``: a streamed model's copies
    (``StreamedLayers.transfers``), the wait and the idle starts on a GPU only."""
    rate = f" at {t['copy_gib_per_s']:.1f} GiB/s" if t["copy_gib_per_s"] else ""
    stall = f"; the compute waited {t['stall_s']:.2f} s for them" if t["stall_s"] is not None else ""
    idle = (f"; the device had run dry at {t['idle_entries']} of {t['entries']} layer starts"
            if t.get("idle_entries") is not None else "")
    return f"copied {t['copies']} layers, {t['copied_gib']:.2f} GiB{rate}{stall}{idle}"


# Past these shares of a run the copies, or the host, set its pace: worth a line on what to change.
STALL_SHARE = 0.2
IDLE_SHARE = 0.5


def describe_pace(t: dict, seconds: float, training: bool) -> str | None:
    """What set a streamed run's pace, where the copies or the host did, and what to change;
    None where neither did (or on a CPU, where neither is measured). ``t``: the run's transfers
    (``describe_transfers``), ``seconds``: its wall time, ``training``: a ``train`` run (whose
    options differ from a cache build's)."""
    if t.get("stall_s") is not None and seconds > 0 and t["stall_s"] >= STALL_SHARE * seconds:
        more = ("a larger --batch-size, more --resident-layers or --turn-layers" if training
                else "a larger --max-tokens")
        return (f"the copies set the pace: the compute waited {t['stall_s']:.1f} s of {seconds:.1f} s for them; "
                f"more tokens per copy or fewer copies would hide them ({more}; docs/memory.md)")
    if t.get("idle_entries") and t["entries"] and t["idle_entries"] >= IDLE_SHARE * t["entries"]:
        how = "--compile on" if training else "a larger --max-tokens"
        return (f"the host set the pace: the device had run dry at {t['idle_entries']} of {t['entries']} layer "
                f"starts ({how} gives it less to do per token)")
    return None


def cmd_info(args) -> int:
    cache_dir = args.cache_dir or default_cache_dir()
    dirs = namespace_dirs(cache_dir)
    if not dirs:
        print(f"{cache_dir}: no cached namespaces")
    _print_token_stores(Path(cache_dir))
    status = 0
    pair_stores = []  # opened once: listed, then counted against the data
    for ns_dir in dirs:
        if has_pair_values(ns_dir):
            pair_stores.append(open_namespace_dir(ns_dir))
            status |= _print_pair_values(pair_stores[-1])
        if (ns_dir / SEQUENCES).is_dir():
            status |= _print_look_aside_values(ns_dir)
    if args.tokenizer and args.data:
        status |= _print_coverage(args, pair_stores)
    return status


def _print_pair_values(store: CacheStore) -> int:
    """A namespace's pair cache in one line, and a line per damaged shard; 1 where there is one."""
    ns_dir, ns = store.dir, store.namespace
    per_token = sum(s.info.pairs for s in store.shards if s.info.per_token)
    print(f"{ns_dir.name}  model {ns.model}  dtype {ns.dtype}  pairs {len(store)} (per-token {per_token})  "
          f"shards {len(store.shards)}  size {_human_bytes(store.size_bytes())}")
    for bad in store.corrupt:
        print(f"  CORRUPT {ns_dir / bad.file}: {bad.reason}")
    return 1 if store.corrupt else 0


def _print_look_aside_values(ns_dir: Path) -> int:
    """A namespace's look-aside values (``sequences/``: the reference service's, ``dpocache
    score``'s, ``CachedGRPOTrainer``'s) in one line, its own directory named (the one to remove
    when no longer needed), and a line per damaged shard; 1 where there is one."""
    store = SequenceStore.in_directory(ns_dir)
    ns, files = store.namespace, store.shard_files()
    temperature = f"  temperature {ns.temperature:g}" if ns.temperature != 1.0 else ""
    print(f"{ns_dir.name}/{SEQUENCES}  model {ns.model}  dtype {ns.dtype}{temperature}  sequences {len(store)} "
          f"(look-aside)  shards {len(files) - len(store.corrupt)}  "
          f"size {_human_bytes(sum(f.lstat().st_size for f in files))}")
    for bad in store.corrupt:
        print(f"  CORRUPT {store.dir / bad}")
    return 1 if store.corrupt else 0


def _print_token_stores(cache_dir: Path) -> None:
    """One line per token store (docs/data.md): its data file when written, pairs, tokens, size."""
    for store in token_stores(cache_dir):
        meta = store.get("meta")
        if meta:
            what = (f"pairs {meta['pairs']}  tokens {meta['tokens']} (prompts, chosen and rejected)  "
                    f"from {meta['source']}{_store_settings(meta)}")
        elif store["path"].name.startswith(PARTIAL_PREFIX):
            what = "partial (the chunks a build that stopped had tokenized: the next build of this data takes them)"
        else:
            what = "incomplete (a build that did not finish: never read, removed by the next build)"
        print(f"tokens/{store['path'].name}  {what}  size {_human_bytes(store['bytes'])}")


def _store_settings(meta: dict) -> str:
    """What a token store's ``meta.json`` records beside its data (stores written before it did: nothing)."""
    settings = meta.get("settings") or {}
    limits = [f"{name} {settings[name]}" for name in ("max_length", "max_prompt_length") if settings.get(name)]
    return "".join(f"  {part}" for part in limits) + (f"  written {meta['created']}" if meta.get("created") else "")


def _print_coverage(args, stores: list[CacheStore]) -> int:
    """``cache info --model M --data D``: how many of D's pairs (tokenized as ``train`` would,
    with M's tokenizer) each of the namespaces' ``stores`` holds; 1 where the namespace of M in
    ``--dtype`` (the one a run of these settings reads: its weights hashed, no model loaded)
    lacks some. Another model's values serve no run of M."""
    data = _load_data(args, load_tokenizer(args.tokenizer))
    keys = [p.key for p in data.pairs]
    cache_dir = args.cache_dir or default_cache_dir()
    dtype = resolve_dtype(args.dtype, torch.device(args.device) if args.device else default_device())
    ours = namespace_for_dir(args.model, dtype, cache_dir, args.reference, read_only=True)
    print(f"{args.data}: {len(keys):,} pairs (--max-length {args.max_length})")
    if args.dtype == "auto":
        print(f"  --dtype auto is {dtype_name(dtype)} on this machine; a run elsewhere may choose another (pass "
              "--dtype as the run will)")
    missing_in = {store.namespace.id: len(store.missing(keys)) for store in stores}
    for store in stores:
        missing, mine = missing_in[store.namespace.id], store.namespace.id == ours.id
        print(f"  {store.dir.name} ({store.namespace.model}, {store.namespace.dtype}): {len(keys) - missing:,} cached"
              + (f", {missing:,} missing" if missing else ", all") + ("  <- this run's" if mine else ""))
    if ours.id not in missing_in:
        print(f"  {ours.id} ({ours.model}, {ours.dtype}): not in the cache  <- this run's")
        similar = same_config_elsewhere(CacheStore(cache_dir, ours))
        if similar is not None:
            print(f"  {similar.id} has the same config and dtype and other weight files: {SAVED_AGAIN}")
    missing_ours = missing_in.get(ours.id, len(keys))
    if missing_ours:
        print(f"  --model {args.model} in {dtype_name(dtype)} lacks {missing_ours:,} of them: dpocache cache build "
              "with these settings computes them")
    return 1 if missing_ours else 0


def cmd_verify(args) -> int:
    device = torch.device(args.device) if args.device else default_device()
    tokenizer = load_tokenizer(args.tokenizer)
    data = _load_data(args, tokenizer)
    store, dtype = _open_store(args, device)
    reference = _load_reference(args, dtype, device)
    report = verify(store, data.pairs, reference, args.samples, args.seed, tokenizer.pad_token_id or 0,
                    args.max_tokens)
    shards = [bad for bad in report.corrupt_shards if bad.file != MANIFEST]
    gone = sum(1 for bad in shards if not os.path.lexists(store.dir / bad.file))  # listed, not on disk
    hashed = len(store.shards) + len(shards) - gone  # every one on disk, memo or not
    print(f"shards: {hashed} hashed again, {len(shards) - gone} damaged" + (f", {gone} missing" if gone else ""))
    print(f"checked {report.checked} pairs: max |stored - recomputed| = {report.max_abs_diff:.3g}")
    for line in report.mismatches:
        print(f"MISMATCH {line}")
    for bad in shards:
        print(f"CORRUPT {store.dir / bad.file}: {bad.reason}")
    for bad in report.corrupt_shards:
        if bad.file == MANIFEST:
            # The manifest only lists the shards; each shard was checked against its own checksum
            # without it, so a damaged one costs no value and fails nothing.
            print(f"DAMAGED MANIFEST {store.dir / MANIFEST}: {bad.problem}; the shards were checked without it "
                  "(each carries its own checksum); the next cache build or train rebuilds it from them")
    if report.missing:
        print(f"MISSING {report.missing} pairs of the data have no cached value (run dpocache cache build)")
    ok = not report.mismatches and not shards and not report.missing
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def truncation_warning(data: PreferenceData, max_length: int | None, max_prompt_length: int | None,
                       fmt: str | None) -> str | None:
    """The one-line warning of an export whose data has rows dpocache truncated; None if none.
    ``fmt``: the export's format (``keys``: the cache's own table, whose --with-ids shows the tokens)."""
    if not data.truncated:
        return None
    marked = {"keys": "--with-ids shows the tokens scored", "safetensors": "tensor 'truncated' marks them"}
    if max_prompt_length == max_length - 1:  # TRL's cut, but for a prompt that fills max_length (docs/data.md)
        return (f"note: {data.truncated} of {len(data)} rows exceed --max-length {max_length}; with "
                f"--max-prompt-length {max_prompt_length} they were cut as TRL 1.16's collator cuts them (the prompt "
                "whole, the completions their start), except a prompt of max_length tokens or more, which TRL drops "
                f"and which kept its end here ({marked.get(fmt, 'column dpocache_truncated marks them all')})")
    floor = max_prompt_length if max_prompt_length is not None else max_length // 2
    return (f"warning: {data.truncated} of {len(data)} rows exceed --max-length {max_length} and were scored as "
            f"dpocache truncates them (the prompt keeps its end, {floor} tokens or more where it has them, the "
            "completions their start); TRL 1.16's collator keeps the start of prompt + completion instead (and "
            "drops rows whose prompt fills max_length), so these rows' exported values belong to other tokens than "
            f"TRL would train on ({marked.get(fmt, 'column dpocache_truncated marks them')})")


def cmd_export(args) -> int:
    device = torch.device(args.device) if args.device else default_device()
    tokenizer = load_tokenizer(args.tokenizer)
    data = _load_data(args, tokenizer)
    # Said before the values are read, so that it shows even when the export then fails.
    warning = truncation_warning(data, args.max_length, args.max_prompt_length, args.format)
    if warning:
        print(warning, file=sys.stderr)
    store, _ = _open_store(args, device)
    from dpocache.cache.export import export

    try:
        written = export(args.format, args.out, args.data, store, data.pairs, args.with_ids, show_progress=True)
    except MissingReferenceError as err:
        other = other_dtype_elsewhere(store)
        err.hint = (f"; namespace {other.id} holds this model's values in {other.dtype}: --dtype {other.dtype} reads "
                    "them; or build them in this dtype" if other is not None else "; build them first")
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' own error on a full disk names no file: say which
        errno_ = disk_errno(err)
        if errno_ is None or isinstance(err, OSError):
            raise  # an OSError names its file already (disk_errors)
        raise UsageError(f"--out {args.out}: cannot write it: {os.strerror(errno_)}; the cache is unchanged and "
                         "no partial file is left") from None
    print(f"wrote {written} rows to {args.out} ({args.format})")
    return 0


def run(args: argparse.Namespace) -> int:
    """``args``: from ``dpocache.cli.cache_args.parse_args`` (the configuration, paths checked)."""
    if args.cache_command != "build" and int(os.environ.get("RANK", "0")) != 0:
        return 0  # only build shares its work across torchrun's ranks; the others run once, on rank 0
    if args.cache_command == "build":
        check_cache_dir(args.cache_dir or default_cache_dir())  # read-only: nothing to build, or one line
    if args.cache_command == "export":
        check_output(args.out, "--out", {"--data": args.data, "--model": args.model, "--tokenizer": args.tokenizer},
                     directory=args.format == "datasets")
        check_writable_dir(args.out.parent, "--out")
    commands = {"build": cmd_build, "info": cmd_info, "verify": cmd_verify, "export": cmd_export}
    try:
        with disk_errors(cache_dir=args.cache_dir or default_cache_dir()):
            return commands[args.cache_command](args)
    except MissingReferenceError as err:  # export: the build to run, as this command named everything
        print(f"dpocache cache {args.cache_command}: error: {err.missing} of the data's pairs have no cached "
              f"reference log-probs{getattr(err, 'hint', '; build them first')}: {build_command(args.given)}",
              file=sys.stderr)
        return 1
    except CacheError as err:  # a missing value, or a distributed build that left holes
        print(f"dpocache cache {args.cache_command}: error: {err}", file=sys.stderr)
        return 1


def build_command(rest: list[str]) -> str:
    """``cache export``'s arguments (``CONFIG --model M ... --out F --format keys``) as the
    ``cache build`` with the same settings (export's own options dropped), for the user to paste."""
    own = {f"--{name.replace('_', '-')}" for name in OPTIONS["export"]}
    kept, skip = [], False
    for i, arg in enumerate(rest):
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in own:  # and its value, where it takes one and has it apart
            takes_value = flag != "--with-ids" or (i + 1 < len(rest) and rest[i + 1].lower() in BOOL_WORDS)
            skip = "=" not in arg and takes_value
            continue
        kept.append(arg)
    return shlex.join(["dpocache", "cache", "build", *kept])
