"""Process hygiene: every helper process we fork dies with us, signals become a stop event, and
process trees are found through psutil (:func:`descendants`, :func:`pid_alive`).

hivemind runs the DHT and each averager in forked processes, and the DHT process runs p2pd. If an
island is SIGKILLed those children would otherwise live on (a "dead" island that still answers).
:func:`install_child_hooks` makes the kernel kill every forked child when its parent dies
(``PR_SET_PDEATHSIG``) and moves it to its own process group, so a terminal's Ctrl+C reaches only the
main process, which then shuts the children down in order. p2pd exits when its DHT process does.
With ``P2P_DILOCO_GC_FREEZE=1`` (the lab's swarm-scale runs) it also freezes the garbage
collector's objects before each fork (``gc.freeze``, as the Python documentation advises for fork
without exec), so a child's collections do not write to, and so copy, every page of the parent's
objects: a DHT process then keeps 22 MiB of its own instead of 120 MiB. It is not the default yet
(docs/SCALE.md, "Memory per island").
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_installed = False
_forking_pid: int | None = None
_prctl = None  # resolved once in the parent: loading a library in a freshly forked child is risky


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()
    if os.environ.get("P2P_DILOCO_GC_FREEZE") == "1":
        gc.freeze()  # the objects alive now are never collected, in the parent either: imports, the model


def _after_fork_in_child() -> None:
    try:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.setpgid(0, 0)
    except OSError:  # children then rely on hivemind's own shutdown
        pass
    # the parent's StopSignal handler means nothing here: terminate() must end us, and Ctrl+C is
    # the parent's to handle (hivemind ignores SIGINT in its processes too); CPython makes the
    # forking thread the child's main thread, so this is allowed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _forking_pid is not None and os.getppid() != _forking_pid:
        os._exit(1)  # the parent died between fork and prctl


def install_child_hooks() -> None:
    """Register the fork hooks once per process (call from ``main()`` before starting hivemind).

    Children must be forked from the main thread: the kernel sends the parent-death signal when the
    forking *thread* exits.
    """
    global _installed, _prctl
    if not _installed and sys.platform.startswith("linux"):
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = None
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _installed = True


class StopSignal:
    """SIGINT/SIGTERM set :attr:`event`; a second signal exits at once (code 130).

    hivemind's averager sets SIGINT to "ignore" in the calling process when it starts, so call
    :meth:`install` again after creating averagers.
    """

    def __init__(self) -> None:
        self.event = threading.Event()  # also set by other reasons to stop (a dead helper process)
        self.received: str | None = None
        self.signals = 0

    def install(self) -> "StopSignal":
        """Install the handlers (main thread only); returns self."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        self.signals += 1
        if self.signals > 1:
            logger.warning("second %s: exiting now", name)
            os._exit(130)
        self.received = name
        logger.info("%s received: shutting down (again to force)", name)
        self.event.set()


def exit_with_parent(stop: StopSignal, interval: float = 1.0) -> None:
    """Set ``stop`` when the process that started us exits (launchers such as the demo set
    ``P2P_DILOCO_EXIT_WITH_PARENT=1`` so a SIGKILLed launcher leaves no swarm behind)."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.event.wait(interval):
            if os.getppid() != parent:
                logger.warning("the launcher (pid %d) exited: shutting down", parent)
                stop.received = "parent exit"
                stop.event.set()
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_launcher(command: list[str], settle: float = 5.0) -> int:
    """Run a launcher that starts worker processes (torchrun) as our child and pass each SIGINT and
    SIGTERM we get on to its workers alone, so they stop as they would on their own and the launcher
    then exits as it does when they finish (torchrun, signalled itself, ends with a traceback and
    code 1). The launcher runs in a session of its own (a terminal's Ctrl+C reaches only us) and is
    sent SIGTERM by the kernel if we die. A second signal reaches the workers as a second signal
    (they then exit at once).

    After a signal the launcher must not start the workers again (torchrun restarts workers that
    ended with an error, ``--max-restarts``): when it has no workers at the signal, or still runs
    ``settle`` seconds after the signalled workers ended, it gets SIGTERM itself and we return 130.

    :returns: the launcher's exit code (128 + N when signal N ended it)
    """
    import subprocess

    import psutil

    libc_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def die_with_us() -> None:  # runs in the forked child before exec
        if libc_prctl is not None:
            libc_prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    launcher = subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_us)
    signalled: set[int] = set()  # the workers we passed a signal to
    state = {"gone_since": None, "terminated": False}  # (when the signalled workers were all gone)

    def terminate() -> None:
        if not state["terminated"]:
            state["terminated"] = True
            launcher.terminate()

    def forward(signum, _frame) -> None:
        try:
            workers = psutil.Process(launcher.pid).children()
        except psutil.Error:
            return
        if not workers:  # starting or restarting them: nothing to stop gracefully
            terminate()
        for worker in workers:
            try:
                worker.send_signal(signum)
                signalled.add(worker.pid)
            except psutil.Error:
                pass

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    while True:
        try:
            code = launcher.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if signalled and not any(pid_alive(pid) for pid in signalled):
            state["gone_since"] = state["gone_since"] or time.monotonic()
            if time.monotonic() - state["gone_since"] > settle:  # it restarts them: end it
                terminate()
    if state["terminated"]:
        return 130
    return 128 - code if code < 0 else code


def descendants(pid: int) -> list[int]:
    """PIDs of every live (not zombie) descendant of ``pid``; empty if it is gone."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [child.pid for child in children if pid_alive(child.pid)]


def children(pid: int) -> list[int]:
    """PIDs of the live direct children of ``pid``."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children() if pid_alive(child.pid)]
    except psutil.Error:
        return []


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
