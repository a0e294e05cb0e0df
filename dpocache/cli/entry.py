"""The ``dpocache`` command.

    dpocache cache build|info|verify|export [CONFIG.yaml] [--key value ...]
    dpocache score --model M --data rows.jsonl --out logps.jsonl
    dpocache train [CONFIG.yaml] [--key value ...]
    dpocache demo [--output-dir DIR]
    dpocache plot OUTPUT_DIR

``cache`` and ``train`` read one typed configuration (``dpocache.config``): the same YAML file,
the same ``--section.field`` flags, the same defaults. ``-v`` (anywhere) logs more and shows
the traceback of an error.

Exit codes: 0 success, 1 a check failed (verify, corrupt shards), 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import select
import signal
import sys
import traceback

from dpocache.config import ConfigError, validate_environment
from dpocache.data.rows import DataError
from dpocache.runtime.allocator import configure_cpu_allocator, configure_cuda_allocator
from dpocache.runtime.console import quiet_libraries
from dpocache.runtime.preflight import UsageError
from dpocache.runtime.signals import Interrupted, ignore_stop_signals, stop_signals, stop_with_the_launcher

DESCRIPTION = ("dpocache computes the DPO reference log-probabilities of a preference data set once, keeps them in "
               "a verified on-disk cache, and trains policies on them without running the reference model again.")
EPILOG = ("Run `dpocache COMMAND --help` for a command's options, or `dpocache demo` for a complete run on a tiny "
          "model built offline. Exit status: 0 success, 1 a check failed, 2 bad input or usage.")

# Commands whose options are the configuration's fields: everything after them is parsed by
# dpocache.config, not argparse (which would take an unknown flag's value for CONFIG.yaml).
CONFIG_COMMANDS = {("train",), ("cache", "build"), ("cache", "verify"), ("cache", "export"), ("cache", "info")}

# Commands whose flags argparse reads (the others' are the configuration's, or demo's overrides of
# it): an unknown one is named, with the closest real flag, before argparse reads them.
ARGPARSE_COMMANDS = ("score", "plot")

# Mistakes the user can fix: one line, exit status 2.
USER_ERRORS = (DataError, ConfigError, UsageError, FileNotFoundError, FileExistsError, NotADirectoryError)


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (argparse prints the whole usage first)."""

    commands: dict[str, argparse.ArgumentParser]  # the top-level parser's: each command's parser

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_with_closest_choice(message)} (see {self.prog} --help)\n")


# argparse's words for a command that is not one: "argument COMMAND: invalid choice: 'traim' (choose from ...)"
_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<typed>[^']*)' \(choose from (?P<choices>.*)\)$")


def _with_closest_choice(message: str) -> str:
    """argparse's message, with the closest real command where one is near the one typed
    ("did you mean 'train'?"); as it was otherwise."""
    match = _INVALID_CHOICE.search(message)
    if not match:
        return message
    choices = [c.strip().strip("'") for c in match["choices"].split(",")]  # quoted or not, by Python version
    close = difflib.get_close_matches(match["typed"], choices, n=1, cutoff=0.6)
    return f"{message}; did you mean '{close[0]}'?" if close else message


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dpocache", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="store_true", help="more logging, and the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cache = sub.add_parser("cache", help="build, inspect, verify or export the reference cache")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="SUBCOMMAND")
    for name, text in (("build", "compute the reference log-probs the cache lacks"),
                       ("info", "namespaces, their model and dtype, pair counts, size on disk"),
                       ("verify", "check every shard's checksum and recompute a sample"),
                       ("export", "cached values of every row, in data order (JSON lines, or --format "
                                  "jsonl, parquet, datasets, safetensors)")):
        c = csub.add_parser(name, help=f"{text} (see dpocache cache {name} --help)", add_help=False)
        # Everything after the subcommand is ours to parse (dpocache.cli.cache_args), as for train.
        c.add_argument("rest", nargs=argparse.REMAINDER)

    from dpocache.cli.train import add_train_parsers

    add_train_parsers(sub)
    from dpocache.cli.score import add_score_parser

    add_score_parser(sub)
    parser.commands = sub.choices
    return parser


def unknown_flags(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """One line for the ``--flags`` among ``args`` that ``parser`` has no option for (nor one they
    start, which argparse accepts), each with the closest real flag; None if there are none.
    Before argparse reads them: a typo of a required flag was "the following arguments are
    required", which names the flag but not the typo."""
    # argparse has no public list of a parser's options; this mapping has been there since 2.7.
    options = [o[2:] for o in parser._option_string_actions if o.startswith("--")]
    problems = []
    for arg in args:
        if arg == "--":
            break  # what follows is not options
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or any(o.startswith(flag[2:]) for o in options):
            continue
        close = difflib.get_close_matches(flag[2:], options, n=1)
        problems.append(f"unknown flag {flag}; " + (f"did you mean --{close[0]}?" if close else
                                                    f"see {parser.prog} --help"))
    return " | ".join(problems) or None


def _command_name(argv: list[str]) -> tuple[str, ...]:
    for words in CONFIG_COMMANDS:
        if tuple(argv[:len(words)]) == words:
            return words
    return tuple(argv[:1]) if argv[:1] and not argv[0].startswith("-") else ()  # "--bogus train": no command


def say(line: str) -> None:
    """One line to stderr in one write: under torchrun the ranks share the stream, and print's
    separate write of the newline let another rank's line land in the middle of this one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """The ``dpocache`` command; its exit status. A reader that closed stdout early (``dpocache
    train --help | head -1``) ends it quietly, as it ends other Unix commands, not with a
    BrokenPipeError traceback."""
    try:
        return _main(argv)
    except BrokenPipeError:
        if not _stdout_reader_gone():  # some other pipe or socket: not ours to hide
            raise
        # Python's own recipe: stdout to /dev/null, so the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # what a shell reports for a command a closed pipe stopped


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (a captured stdout), no poll
        return False


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # -v is accepted anywhere: before the command, or among a command's own options.
    verbose = any(a in ("-v", "--verbose") for a in argv)
    argv = [a for a in argv if a not in ("-v", "--verbose")]
    words = _command_name(argv)
    if words in CONFIG_COMMANDS:
        argv = [*words, "--", *argv[len(words):]]
    parser = build_parser()
    prog = " ".join(["dpocache", *words])
    if words and words[0] in ARGPARSE_COMMANDS:
        problem = unknown_flags(parser.commands[words[0]], argv[1:])
        if problem:
            say(f"{prog}: error: {problem}")
            return 2
    args, extra = parser.parse_known_args(argv)
    args.verbose = verbose  # taken out of argv above; score reads it to show its errors' traceback
    quiet_libraries(verbose)  # before transformers, datasets or the Hub is imported
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if extra and words not in CONFIG_COMMANDS and args.command != "demo":
        print(f"{prog}: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    try:
        validate_environment()  # before the allocator reads its variable
        configure_cpu_allocator()
        configure_cuda_allocator()
        # SIGTERM/SIGINT while loading end here at once; builds and training stop at safe points.
        with stop_signals():
            stop_with_the_launcher()
            if args.command == "cache":
                from dpocache.cli.cache_args import parse_args

                parsed = parse_args(args.cache_command, args.rest)  # before the heavy imports of cache_cli
                if parsed is None:
                    return 0  # --help
                from dpocache.cli import cache as cache_cli
                return cache_cli.run(parsed)
            if args.command == "score":
                from dpocache.cli import score as score_cli
                return score_cli.run(args)
            from dpocache.cli import train as train_cli
            return train_cli.run(args, extra)
    except USER_ERRORS as err:
        if verbose:
            traceback.print_exc()
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        say(f"{prog}: error: {message}")
        return 2
    except Interrupted as stop:
        ignore_stop_signals()
        # Under torchrun every rank stops; rank 0 speaks for them unless the signal was this rank's alone.
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or stop.received_here:
            # torchrun ends the other ranks with SIGTERM when one exits: not necessarily the scheduler's
            launcher = ("; under torchrun a SIGTERM also comes when another rank exits: see its line"
                        if stop.signum == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ else "")
            say(f"dpocache{f' (rank {rank})' if rank else ''}: {stop}{launcher}")
        return stop.exit_code
    except Exception as err:
        if not lost_peer(err):
            raise
        # Another rank exited (an error or a stop signal of its own, which it reported) while this
        # one waited for it in a collective: one line here, not a traceback from every survivor.
        ignore_stop_signals()
        if verbose:
            traceback.print_exc()
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if first.startswith("[") and "] " in first:  # gloo's "[source file:line] message"
            first = first.split("] ", 1)[1]
        say(f"dpocache (rank {os.environ.get('RANK', '?')}): stopped because another rank exited "
            f"(see its message): {first}")
        return 1


# What a collective raises when a peer process is gone: gloo a RuntimeError naming the closed
# connection; NCCL and the store torch.distributed's DistError.
PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe")


def lost_peer(err: BaseException) -> bool:
    """Whether ``err``, in a process of a multi-process job, is a collective that failed
    because another rank exited."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in PEER_GONE)
