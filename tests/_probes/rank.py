"""A rank that writes down what it can observe of how it was started, then ends as told
(``tests/test_forked.py``): run by the supervisor as ``--module _probes.rank`` with ``tests/`` on
``PYTHONPATH`` (a module in a package, as the trainer is: runpy warns when such a module was imported
before it runs as ``__main__``).

    python -m _probes.rank --run-dir RUN [--rank1 ok|exit3|raise]

Each rank writes ``RUN/probe-rank<r>.json``; rank 1 then ends with status 3 (``exit3``) or an
uncaught ValueError (``raise``), rank 0 (and rank 1 with ``ok``) through ``exit_process(0)`` as the
trainer does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import stat
import sys
from pathlib import Path

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGPIPE")


def _disposition(sig: signal.Signals) -> str:
    h = signal.getsignal(sig)
    if h is signal.SIG_DFL:
        return "default"
    if h is signal.SIG_IGN:
        return "ignored"
    if h is signal.default_int_handler:
        return "KeyboardInterrupt"
    return f"handler {getattr(h, '__qualname__', h)!r}"


def _death_signal() -> int:
    """prctl(PR_GET_PDEATHSIG): the signal this process gets when its parent dies (0: none)."""
    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(value), 0, 0, 0)
    return value.value


def facts(argv: list[str]) -> dict:
    import torch

    rank = int(os.environ["RANK"])
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += stat.S_ISSOCK(os.fstat(int(fd)).st_mode)
        except OSError:
            pass
    # unbuffered output: a line not yet ended is already in the rank's log file
    marker = f"probe-partial-line-{rank}"
    sys.stdout.write(marker)
    with open(os.readlink("/proc/self/fd/1")) as f:
        unbuffered = marker in f.read()
    sys.stdout.write("\n")
    return {
        "main": __name__, "argv": argv, "own_session": os.getsid(0) == os.getpid(),
        "own_process_group": os.getpgid(0) == os.getpid(),
        "signals": {name: _disposition(getattr(signal, name)) for name in SIGNALS},
        "death_signal": _death_signal(), "sockets": sockets, "unbuffered": unbuffered,
        "torch_threads": torch.get_num_threads(), "cuda_bad_fork": torch.cuda._is_in_bad_fork(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                "MASTER_ADDR", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT")},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--rank1", choices=("ok", "exit3", "raise"), default="ok")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    (Path(args.run_dir) / f"probe-rank{rank}.json").write_text(json.dumps(facts(sys.argv[1:])))
    if rank == 1 and args.rank1 == "exit3":
        sys.exit(3)
    if rank == 1 and args.rank1 == "raise":
        raise ValueError("the probe's rank 1 fails here")
    return 0


if __name__ == "__main__":
    from workbench.util import exit_process

    exit_process(main())
