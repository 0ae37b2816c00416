"""Ranks forked from the supervisor: a run's ranks start with torch already imported.

The supervisor is torchrun, so it has imported torch before any rank starts. torchrun starts a
``-m module`` rank as a new interpreter that imports torch again: 1.2-1.8 s of CPU per rank, every
run, every restart (a 2-rank tiny run on 2 cores spends more on that than on its steps). With
``--start-method fork`` (the supervisor's default on Linux with a CPU build of torch;
``$WORKBENCH_RANK_START`` chooses too) torchrun's elastic agent starts each
rank as a function, by fork, and the rank runs its module as ``python -u -m module`` would, with
what makes a rank a rank kept as an exec-started one has it:

- no inherited sockets (the rendezvous store's port is the supervisor's alone);
- its own session and process group (torchrun's subprocesses get ``start_new_session``; the
  supervisor's sweep and a rank's parent watchdog rely on it);
- default signal dispositions (not the supervisor's handlers), and no death signal from
  ``torch.multiprocessing`` (a rank watches its parent itself, as before);
- unbuffered stdout and stderr on the per-rank log files (``-u``), also for its children;
- ``OMP_NUM_THREADS`` applied to torch's intra-op threads: the supervisor's OpenMP runtime read
  its environment before torchrun set the ranks' value;
- its exit status: ``sys.exit(code)``, an uncaught exception (its traceback in the rank's log,
  status 1), a signal. ``workbench.util.exit_process`` raises instead of ``os._exit`` here, so
  torchrun receives the rank's result and multiprocessing ends the process without finalization.

CUDA must never be initialised in the supervisor (a forked child cannot use it): the supervisor
never touches the GPU, torchrun's own CUDA checks go through NVML (``cuda_checks_without_init``),
and it refuses to fork its ranks if torch says CUDA was initialised (``refuse_cuda``). With a CUDA
build of torch ranks start by ``exec`` unless ``WORKBENCH_RANK_START=fork``: forked ranks have not
run on a GPU yet.
``--start-method exec`` starts ranks as new interpreters, exactly as torchrun's CLI does.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import signal
import stat
import sys
import traceback

from workbench.util import flush_std_streams

START_METHODS = ("fork", "exec")


START_METHOD_ENV = "WORKBENCH_RANK_START"
"""The environment variable that chooses how a run's ranks start (``fork`` or ``exec``) where the
supervisor's ``--start-method`` is not given: ``WORKBENCH_RANK_START=exec workbench train ...``."""


def start_method() -> str:
    """How ranks start: ``$WORKBENCH_RANK_START`` if set; else ``fork`` on Linux with a CPU build of
    torch (CPU machines, CI), ``exec`` with a CUDA build (forked ranks have not run on a GPU yet: a
    GPU machine keeps the start its checks measured) and off Linux (macOS forks a process that has
    loaded torch unreliably). Raises ValueError for another value."""
    chosen = os.environ.get(START_METHOD_ENV, "").strip()
    if not chosen:
        import torch

        return "fork" if sys.platform.startswith("linux") and not torch.backends.cuda.is_built() else "exec"
    if chosen not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV} must be one of {', '.join(START_METHODS)}, got {chosen!r}")
    return chosen


NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""torch's switch for CUDA checks through NVML, which do not initialise CUDA (``cuda_checks_without_init``)."""


@contextlib.contextmanager
def cuda_checks_without_init():
    """While torchrun builds its launch configuration in the supervisor: its CUDA checks
    (``LaunchConfig`` asks ``torch.cuda.is_available()`` and the device count, to choose NUMA
    bindings) go through NVML, which does not initialise CUDA, instead of ``cudaGetDeviceCount``,
    which does, and would leave every forked rank unable to use the GPU
    (``PYTORCH_NVML_BASED_CUDA_CHECK``; torch falls back to the CUDA runtime where NVML cannot
    answer)."""
    before = os.environ.get(NVML_CHECK_ENV)
    os.environ[NVML_CHECK_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NVML_CHECK_ENV, None)
        else:
            os.environ[NVML_CHECK_ENV] = before


def preload(modules) -> None:
    """Import ``modules`` in this process (the supervisor) before its ranks fork, so that every rank
    finds them imported. A rank's own module may be among them: ``rank_main`` runs it afresh as
    ``__main__`` all the same (as ``python -m`` would), with its dependencies already loaded."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - each rank imports it again and reports the error as it comes
            pass


def _unbuffered() -> None:
    """Unbuffered stdout and stderr on whatever files fd 1 and 2 are now (the rank's log files),
    as ``python -u`` gives; children started afresh (the plan-ahead worker) inherit the setting."""
    flush_std_streams()
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                            errors=old.errors, line_buffering=True, write_through=True))
    os.environ["PYTHONUNBUFFERED"] = "1"


def _no_parent_death_signal() -> None:
    """Undo ``torch.multiprocessing``'s request for SIGINT when the supervisor dies (prctl
    PR_SET_PDEATHSIG): a rank notices that itself and ends as an exec-started one does
    (``runtime.train``'s parent watchdog)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG, no signal
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        pass


def _close_inherited_sockets() -> None:
    """Close the supervisor's sockets this process inherited (the rendezvous store's listening socket,
    the agent's store connections): an exec-started rank has none, and a rank holding them keeps the
    store's port open after the supervisor closed it. torchrun's own plumbing to the rank (its result
    queue, the log files) is pipes and files, left open."""
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:  # pragma: no cover - no /proc
        return
    for fd in fds:
        if fd <= 2:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass


def _forget(module: str) -> None:
    """Drop ``module`` from the modules imported (``preload`` may have imported it), so that runpy runs
    it as a fresh ``__main__``, as ``python -m`` does, and not beside a copy it warns about."""
    if sys.modules.pop(module, None) is not None and "." in module:
        parent, _, child = module.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
            delattr(sys.modules[parent], child)


def refuse_cuda() -> None:
    """Raise RuntimeError, in the supervisor before its ranks fork, if this process has initialised
    CUDA: a forked process cannot use its parent's CUDA context."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(f"the supervisor has initialised CUDA, which forked ranks cannot use: start the run "
                           f"with {START_METHOD_ENV}=exec")


def rank_main(module: str, *argv: str) -> None:
    """One rank, in a process forked by torchrun's agent (the supervisor): run ``module`` as
    ``__main__`` with ``argv``. Returns when the rank ended with status 0; otherwise the process ends
    with the rank's status (``SystemExit``) or the exception it raised."""
    import torch

    from workbench import util

    os.setsid()
    _close_inherited_sockets()
    _no_parent_death_signal()
    for s in signal.valid_signals():  # the supervisor's (and torchrun's) handlers are not the rank's
        if callable(signal.getsignal(s)) and s != signal.SIGINT:
            signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _unbuffered()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    util.EXIT_BY_RAISING = True
    _forget(module)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        flush_std_streams()
        if e.code is None or e.code == 0:
            return
        raise
    except KeyboardInterrupt:
        # as the interpreter does: the traceback, then death by SIGINT
        traceback.print_exc()
        flush_std_streams()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()  # the interpreter would print it to the rank's log; multiprocessing does not
        flush_std_streams()
        raise
    flush_std_streams()
