"""The ``dpocache`` command.

    dpocache cache build|info|verify|export ...
    dpocache train [CONFIG.yaml] [--key value ...]
    dpocache demo
    dpocache plot OUTPUT_DIR

Exit codes: 0 success, 1 a check failed (verify, corrupt shards), 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .allocator import configure_cpu_allocator
from .data import DataError


def _add_common_cache_args(p: argparse.ArgumentParser, needs_data: bool = True) -> None:
    p.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $DPOCACHE_CACHE_DIR or ~/.cache/dpocache)")
    if needs_data:
        p.add_argument("--model", required=True, help="reference model directory (Hugging Face format; a PEFT adapter dir means its base)")
        p.add_argument("--data", required=True, help="preference data: .jsonl/.json/.parquet/.csv or a datasets directory")
        p.add_argument("--max-length", type=int, default=None, help="max tokens of prompt + completion (default: no truncation)")
        p.add_argument("--max-prompt-length", type=int, default=None, help="tokens the prompt keeps at least when truncating (default: max-length/2)")
        p.add_argument("--dtype", default="auto", help="auto (bf16 where the hardware has it), float32, bfloat16")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
        p.add_argument("--max-tokens", type=int, default=None, help="padded tokens per reference forward (default 4096; GPUs like more)")
        p.add_argument("--layout", default="shared", choices=["shared", "padded"],
                       help="shared: each prompt runs once for both completions (default); padded: two rows per pair")
        p.add_argument("--skip-invalid", action="store_true", help="skip bad rows (reported) instead of failing")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpocache", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    cache = sub.add_parser("cache", help="build, inspect, verify or export the reference cache")
    csub = cache.add_subparsers(dest="cache_command", required=True)
    b = csub.add_parser("build", help="compute the reference log-probs the cache lacks")
    _add_common_cache_args(b)
    b.add_argument("--per-token", action="store_true", help="also store per-token log-probs")
    b.add_argument("--shard-size", type=int, default=4096, help="pairs per shard (a shard is also flushed every 60 s)")
    b.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    b.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the reference over the processes (FSDP2)")
    i = csub.add_parser("info", help="namespaces, their model and dtype, pair counts, size on disk")
    _add_common_cache_args(i, needs_data=False)
    v = csub.add_parser("verify", help="check every shard's checksum and recompute a sample")
    _add_common_cache_args(v)
    v.add_argument("--samples", type=int, default=32)
    v.add_argument("--seed", type=int, default=0)
    e = csub.add_parser("export", help="cached values of every row, in data order, as JSON lines")
    _add_common_cache_args(e)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--with-ids", action="store_true", help="include the token ids the values were computed on")

    from .train_cli import add_train_parsers

    add_train_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        # The config tree's flags are parsed by dpocache.config, not argparse (which would take
        # the value of an unknown flag for the positional CONFIG).
        argv = ["train", "--", *argv[1:]]
    args, extra = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if extra and args.command != "train":
        print(f"dpocache: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    configure_cpu_allocator()
    try:
        if args.command == "cache":
            from . import cache_cli

            return cache_cli.run(args)
        from . import train_cli

        return train_cli.run(args, extra)
    except DataError as err:
        print(f"dpocache: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as err:
        print(f"dpocache: error: {err}", file=sys.stderr)
        return 2

