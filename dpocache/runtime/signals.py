"""Stop signals: SIGTERM (what Slurm, Kubernetes, ``timeout`` and torchrun send first), SIGINT
(Ctrl-C), SIGUSR1 (what Slurm's ``--signal=USR1@SECONDS`` sends ahead of a pre-emption or the
time limit) and SIGHUP (a closed SSH session) stop a cache build or a training run at a safe
point, after what was computed is saved, instead of killing the process mid-work (SIGUSR1's and
SIGHUP's default action kills at once). Under torchrun the agent forwards SIGTERM, SIGINT and
SIGHUP to the workers; SIGUSR1 only with ``--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``
(torchrun's own flag; without it SIGUSR1's default action ends the agent itself, and each worker
then gets SIGTERM: ``stop_with_the_launcher``).

    with stop_signals() as stop:          # handlers installed; the previous ones restored after
        load_things()                     # a signal here raises Interrupted at once (nothing to save)
        with stop.deferred():             # a signal here only sets stop.signum ...
            for batch in batches:
                if stop:                  # ... which the loop checks between units of work
                    break
                work(batch)
            save()
        stop.check()                      # raises Interrupted(signum) if a signal arrived

``Interrupted`` derives from ``BaseException`` (as ``KeyboardInterrupt`` does), so ``except
Exception`` blocks do not swallow it; the command line turns it into one line and exit status
``128 + signum`` (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1, 129 for SIGHUP), what a shell
reports for a process the signal killed. A signal set to be ignored stays ignored (``nohup``
keeps SIGHUP ignored). A repeated signal does not escalate: under torchrun a worker gets Ctrl-C's SIGINT
twice (from the terminal and from the agent, which forwards it), and the safe point must still
be reached. SIGKILL, which cannot be caught, still stops a stuck process; every file written is
atomic, so it never leaves a torn one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
# What a stop that no safe point described says: it came where nothing was being computed (a
# load, a check) or after the work was saved, so the same command goes on from there.
NOTHING_LOST = "nothing computed was lost; run the same command again to go on"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Interrupted(BaseException):
    """A stop signal arrived; raised once what was computed is saved (or nothing was computed)."""

    def __init__(self, signum: int, message: str = "", received_here: bool = True):
        super().__init__(signum, message)
        self.signum = signum
        self.message = message
        self.received_here = received_here  # False: another rank received it, this one stopped with it
        self.summary = None  # what the stopped work had done, where it has a summary (a cache build's)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        name = signal_name(self.signum)
        return f"stopped by {name}: {self.message}" if self.message else f"stopped by {name}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """The signal received inside a ``stop_signals`` block (``signum``, None until one arrives);
    true once a signal arrived."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._deferring = False
        self._handled = False

    def __bool__(self) -> bool:
        return self.signum is not None

    def _on_signal(self, signum: int, frame) -> None:
        if self.signum is None:  # the first signal decides the exit status
            self.signum = signum
        if not self._deferring:
            self._handled = True
            raise Interrupted(signum, NOTHING_LOST)

    @contextlib.contextmanager
    def deferred(self) -> Iterator["StopRequest"]:
        """Within the block a signal only sets ``signum``; the code polls it at safe points."""
        before = self._deferring
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = before

    def interrupted(self, message: str = "", signum: int | None = None) -> Interrupted:
        """The exception to raise at a safe point (``signum``: one another rank received)."""
        self._handled = True
        return Interrupted(signum or self.signum, message, received_here=self.signum is not None)

    def check(self, message: str = "") -> None:
        if self.signum is not None:
            raise self.interrupted(message)


def stop_with_the_launcher() -> None:
    """Under ``torchrun``: SIGTERM to this worker when its launcher (the agent, its parent) ends,
    however it ends. A SIGUSR1 the agent was not told to handle (no ``--signals-to-handle ...,
    SIGUSR1``) ends the agent at once and left its workers training on their own, writing to the
    output directory of a job that looked finished; now they stop at their next safe point, as
    for a SIGTERM the agent forwards. Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere a no-op."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def ignore_stop_signals() -> None:
    """For a process that is exiting because of a stop signal: a repeated one (torchrun sends
    SIGTERM to the workers still running once one has exited) must not cut the exit short."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Route ``signals`` to a ``StopRequest`` within the block; restore the previous handlers
    after it. A signal the block recorded but did not act on raises ``Interrupted`` on leaving
    it (the process was asked to stop; what the block did is complete).

    Signals a parent process set to be ignored (``nohup``, a shell's background job) stay
    ignored, and off the main thread (where Python cannot install handlers) nothing changes.
    """
    stop = StopRequest()
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, stop._on_signal)
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            # None: a handler installed from C, which Python cannot reinstall; the default is closest.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    if stop.signum is not None and not stop._handled:
        raise stop.interrupted(NOTHING_LOST)
