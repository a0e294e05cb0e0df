"""``dpocache score``: per-token reference log-probs of prompts and their completions, offline.

A row of the data is a prompt and its completions, as text (plain, or chat messages rendered
with the tokenizer's chat template and the row's ``tools`` and ``chat_template_kwargs``; checked,
rendered and tokenized as ``cache build`` does) or as token ids::

    {"prompt": "sort: 3 1 2", "completions": [" 1 2 3", " 3 2 1"]}
    {"prompt": [{"role": "user", "content": "..."}], "completions": [[{"role": "assistant", "content": "..."}]]}
    {"prompt_ids": [1, 17, 9], "completion_ids": [[4, 5, 2], [6, 2]]}

Each output line holds the row's index and, per completion, its per-token log-probs, their
sum and its token count. Every chunk of rows scored is in the look-aside cache
(``dpocache.service.reference_service``) before the next starts, so a run that is stopped resumes where it was.

Under ``torchrun`` each process scores its share of the rows (balanced by tokens) on
``cuda:LOCAL_RANK`` into a part file of its own; process 0 then writes the output, in data
order, from the parts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

from tqdm.auto import tqdm

from dpocache.data.pairs import special_prefix, tokenize_continuations, with_eos, with_prefix
from dpocache.data.render import check_text, render_conversation, template_inputs
from dpocache.data.rows import DataError, RawRow, is_messages, read_rows
from dpocache.runtime.preflight import check_model_dir, check_output, check_writable_dir, context_length
from dpocache.runtime.signals import Interrupted


def _user_path(text: str) -> Path:
    """A path flag's value, ``~`` expanded (a shell leaves it in ``--out=~/x``)."""
    return Path(text).expanduser()


def add_score_parser(sub) -> None:
    s = sub.add_parser("score", help="per-token reference log-probs of prompts and their completions (JSONL out)")
    s.add_argument("--model", required=True,
                   help="reference model directory (for a PEFT adapter dir: base + adapter, the initial policy)")
    s.add_argument("--data", required=True, help="rows: prompt + completions (text or messages) or prompt_ids + "
                   "completion_ids; .jsonl/.json/.parquet/.csv")
    s.add_argument("--out", type=_user_path, required=True, help="output JSONL, one line per row, in data order")
    s.add_argument("--cache-dir", type=_user_path, default=None,
                   help="look-aside cache (default: the reference cache root: $DPOCACHE_CACHE_DIR, else "
                   "$XDG_CACHE_HOME/dpocache, else ~/.cache/dpocache)")
    s.add_argument("--dtype", default="auto",
                   help="auto (bf16 on a CUDA GPU with bf16 or a CPU with AMX, else float32), float32, bfloat16, "
                   "float16")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available; under torchrun "
                   "cuda:LOCAL_RANK)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="token slots per forward (default: 4096 on a CPU, 16384 on a GPU)")
    s.add_argument("--chunk-rows", type=int, default=256, help="rows scored (and cached) at a time")
    s.add_argument("--temperature", type=float, default=1.0,
                   help="divide the logits by this before the log-softmax: the sampling temperature of "
                   "the rollouts, as GRPO/PPO trainers do for the reference (default 1: the model's own values)")
    s.add_argument("--stats", type=_user_path, default=None, help="append the service's counters to this JSONL file")
    s.add_argument("--stream-reference", action="store_true",
                   help="keep the model's decoder layers in host memory, each copied to the GPU as it runs "
                   "(docs/memory.md)")


# ------------------------------------------------------------------------------- tokenizing


def _tokenize(row: RawRow, tokenizer, prefix: list[int]) -> dict:
    """A text row as a request, checked and rendered by ``data.render`` as ``cache build`` does: plain
    text gets the special tokens ``cache build`` gives it (``data.special_prefix``/``with_eos``:
    TRL's rule); messages go through the chat template (which adds its own), with the row's
    ``tools`` and ``chat_template_kwargs``."""
    values, loc = row.values, row.location
    prompt, completions = values["prompt"], values.get("completions")
    if "completions" not in values:
        pair = " (a preference pair: give its chosen and rejected as completions: [...])" \
            if {"chosen", "rejected"} <= set(values) else ""
        raise DataError(loc, "completions", f"missing; the row has {', '.join(map(str, values))}{pair}")
    if not isinstance(completions, list) or not completions:
        raise DataError(loc, "completions", "expected a non-empty list")
    names = [f"completions[{k}]" for k in range(len(completions))]
    if is_messages(prompt):
        for name, c in zip(names, completions):
            if not is_messages(c):
                raise DataError(loc, name, "the prompt is messages: give completions as messages")
        prompt_text, texts = render_conversation(loc, prompt, list(zip(names, completions)), tokenizer,
                                                 template_inputs(loc, values))
        (prompt_ids,), (completion_ids,) = tokenize_continuations(tokenizer, [prompt_text], [texts])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
    texts = [check_text(loc, n, c) for n, c in zip(names, completions)]
    (prompt_ids,), (completion_ids,) = tokenize_continuations(tokenizer, [check_text(loc, "prompt", prompt)], [texts])
    eos = tokenizer.eos_token_id
    return {"prompt_ids": with_prefix(prompt_ids, prefix),
            "completion_ids": [with_eos(c, eos) for c in completion_ids]}


def to_request(row: RawRow, tokenizer, prefix: list[int]) -> dict:
    """``prefix``: ``data.special_prefix(tokenizer)``, found once for all rows."""
    values = row.values
    if not isinstance(values, dict):
        raise DataError(row.location, None, f"expected an object, got {type(values).__name__}")
    if "prompt_ids" in values or "completion_ids" in values:
        text = [name for name in ("prompt", "completions") if name in values]
        if text:  # which to score would be a guess: the ids won without a word
            raise DataError(row.location, None, f"both token ids (prompt_ids, completion_ids) and text "
                            f"({', '.join(text)}): give one or the other")
        return {"prompt_ids": values.get("prompt_ids"), "completion_ids": values.get("completion_ids")}
    if "prompt" not in values:
        raise DataError(row.location, "prompt", "missing (give prompt + completions, or prompt_ids + completion_ids)")
    return _tokenize(row, tokenizer, prefix)


def check_rows(rows: list[RawRow], requests: list[dict], model: str | Path) -> None:
    """The service's checks, with the row's location in the message, before the model loads
    (its vocabulary and context are in its config)."""
    from transformers import AutoConfig

    from dpocache.models.directories import reference_weights_dir
    from dpocache.service.reference_service import RequestError, check_request

    config = AutoConfig.from_pretrained(str(reference_weights_dir(model))).get_text_config()
    vocab, context = config.vocab_size, context_length(config.to_dict())
    for i, (row, request) in enumerate(zip(rows, requests)):
        try:
            check_request(i, request, vocab, context)
        except RequestError as e:
            raise DataError(row.location, _field_of(row, e), e.reason) from None


def _field_of(row: RawRow, e) -> str:
    """The row's own field a ``RequestError`` is about: ``completion_ids[1]`` in a row of ids,
    ``completions[1]`` in a row of text (its ids are its tokenized text)."""
    ids = isinstance(row.values, dict) and "prompt_ids" in row.values
    if e.field == "completion_ids":
        name = "completion_ids" if ids else "completions"
        return name if e.completion is None else f"{name}[{e.completion}]"
    return "prompt_ids" if ids else "prompt"


# -------------------------------------------------------------------------------- command


def cmd_score(args) -> int:
    # The model machinery (torch, transformers) is imported when the command runs, as cli.py
    # does for its other commands: building the parser stays light.
    from dpocache.cache import default_cache_dir
    from dpocache.config import device_type, validate_device
    from dpocache.models.hub_ids import resolve_model_path
    from dpocache.models.loading import load_tokenizer
    from dpocache.models.reference import DTYPES
    from dpocache.service.reference_service import ReferenceService

    # Before the rows are read and the model loads (torch's own error came from the model's move).
    validate_device(args.device, "--device")
    if args.stream_reference and device_type(args.device) != "cuda":
        raise DataError("--stream-reference", None, f"streams weights from host memory to a GPU; this run's device is "
                        f"{device_type(args.device)}, where they are in host memory already")
    args.model = resolve_model_path(args.model)  # a Hub id: its snapshot in the local cache, as cache build takes it
    if not Path(args.model).is_dir():
        raise DataError(f"--model {args.model}", None, "not a model directory")
    # Its config and weights now; its tokenizer below, if the rows are text (token ids need none).
    check_model_dir(args.model, "--model", tokenizer=False)
    check_output(args.out, "--out", {"--data": args.data, "--model": args.model})
    # Every path written, before the model loads: a file where a directory goes, or a directory
    # for --stats, failed after the model loaded (--stats after every row was scored).
    check_writable_dir(args.out.parent, "--out")
    if args.stats is not None:
        check_output(args.stats, "--stats", {"--data": args.data, "--model": args.model, "--out": args.out})
        check_writable_dir(args.stats.parent, "--stats")
    check_writable_dir(args.cache_dir or default_cache_dir(), "--cache-dir")
    # The flags' values before the rows are read (a large file takes a while to read).
    for flag, value in (("--chunk-rows", args.chunk_rows), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise DataError(flag, None, f"must be at least 1; got {value}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise DataError("--temperature", None, f"must be a finite number above 0; got {args.temperature}")
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise DataError("--dtype", None, f"must be one of auto, {', '.join(DTYPES)}; got '{args.dtype}'")
    name, rows = read_rows(args.data)
    if not rows:
        raise DataError(name, None, "no rows")
    needs_tokenizer = any(isinstance(r.values, dict) and "prompt" in r.values for r in rows)
    if needs_tokenizer:
        check_model_dir(args.model, "--model")  # without tokenizer files transformers' error was many lines
    tokenizer = load_tokenizer(args.model) if needs_tokenizer else None
    prefix = special_prefix(tokenizer) if tokenizer is not None else []
    requests = [to_request(r, tokenizer, prefix) for r in rows]
    check_rows(rows, requests, args.model)
    env = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from dpocache.distributed.process_group import init_distributed

        env = init_distributed(args.device)  # cuda:LOCAL_RANK, or the CPU
    device = str(env.device) if env is not None else args.device
    try:
        if env is not None:
            from dpocache.distributed.process_group import differing_on_ranks

            # Each rank scores its share of the rows by index: a file that differs between
            # machines would merge rows of two data sets into one output.
            if differing_on_ranks(env, {"rows": requests}):  # compared as a hash of their repr
                raise DataError(f"--data {args.data}", None, "the ranks read different rows from it (a file that "
                                "differs between machines, or is not on a shared disk?); every rank must read the "
                                "same rows")
        service = ReferenceService.from_pretrained(args.model, args.dtype, device, max_tokens=args.max_tokens,
                                                   cache_dir=args.cache_dir or default_cache_dir(),
                                                   stats_file=args.stats, temperature=args.temperature,
                                                   stream=args.stream_reference)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial = args.out.with_name(args.out.name + ".partial")
        if env is None:
            _score_rows(service, rows, requests, range(len(rows)), args.chunk_rows, partial, progress=True)
            s = service.stats()
        else:
            s = _score_share(service, rows, requests, args.chunk_rows, partial, env)
        if env is None or env.is_main:
            os.replace(partial, args.out)
            print(f"rows {len(rows)}: sequences {s['sequences']} ({s['cache_hits']} from the cache, "
                  f"{s['forward_sequences']} computed in {s['forward_passes']} forward passes, {s['tokens']} tokens, "
                  f"{s['seconds']:.1f} s); wrote {args.out}")
    finally:
        if env is not None:
            from dpocache.distributed.process_group import destroy

            destroy(env)
    return 0


def _score_rows(service, rows: list[RawRow], requests: list[dict], positions, chunk_rows: int, path: Path,
                progress: bool) -> None:
    """Score the rows at ``positions`` (in that order), ``chunk_rows`` at a time, one output
    line each into ``path``."""
    positions = list(positions)
    with open(path, "w", encoding="utf-8") as f, tqdm(total=len(positions), unit="rows", desc="reference log-probs",
                                                      dynamic_ncols=True, disable=not progress) as bar:
        for start in range(0, len(positions), chunk_rows):
            chunk = positions[start:start + chunk_rows]
            try:
                scored = service.score([requests[i] for i in chunk])
            except Interrupted as stop:  # the service flushed what it computed: say so, and how to go on
                raise Interrupted(stop.signum, f"{start} of {len(positions)} rows were scored before it; every value "
                                  f"computed is in the look-aside cache ({service.cache_dir}), and the same command "
                                  "continues from them", stop.received_here) from None
            for i, values in zip(chunk, scored):
                f.write(json.dumps({
                    "index": rows[i].index, "token_logps": [v.tolist() for v in values],
                    "logps": [float(v.sum()) for v in values], "tokens": [v.numel() for v in values],
                }) + "\n")
            bar.update(len(chunk))


def _score_share(service, rows: list[RawRow], requests: list[dict], chunk_rows: int, partial: Path, env) -> dict:
    """Under torchrun: this rank's share of the rows (balanced by tokens; every rank computes
    the same split) into a part file of its own; then rank 0 merges the parts, in data order,
    into ``partial``. Returns the service's counters summed over ranks (seconds: the slowest)."""
    from dpocache.distributed.process_group import barrier, reduce_counts, split_by_weight
    from dpocache.service.pool import request_tokens

    shares = [sorted(share) for share in split_by_weight(range(len(rows)), env.world_size,
                                                          weight=lambda i: request_tokens(requests[i]))]
    parts = [partial.with_name(f"{partial.name}.rank{r}") for r in range(env.world_size)]
    _score_rows(service, rows, requests, shares[env.rank], chunk_rows, parts[env.rank], progress=env.is_main)
    s = service.stats()
    counted = ("sequences", "cache_hits", "forward_sequences", "forward_passes", "tokens")
    summed = reduce_counts(env, [s[k] for k in counted])
    s = {**dict(zip(counted, (int(v) for v in summed))), "seconds": reduce_counts(env, [s["seconds"]], "max")[0]}
    barrier(env)  # every part is written and closed
    if env.is_main:
        owner = [0] * len(rows)
        for r, share in enumerate(shares):
            for i in share:
                owner[i] = r
        files = [open(p, encoding="utf-8") for p in parts]
        try:
            with open(partial, "w", encoding="utf-8") as f:
                for r in owner:  # each part holds its rows in data order
                    f.write(files[r].readline())
        finally:
            for handle in files:
                handle.close()
        for p in parts:
            p.unlink()
    return s


def run(args: argparse.Namespace) -> int:
    try:
        return cmd_score(args)
    except (DataError, ValueError) as err:
        if args.verbose:
            traceback.print_exc()  # then the one line and status 2, as cli.main does for the other commands
        print(f"dpocache score: error: {err}", file=sys.stderr)
        return 2
