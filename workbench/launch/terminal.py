"""Following a run from a terminal command (``workbench train``, ``workbench profile``).

The command shows its own progress; this module owns what every such command must do the same
way: a SIGINT, SIGTERM or SIGHUP (a closed terminal) stops the whole run, not only the command,
and a run that does not end ``done`` is reported as its failing rank's last lines and one error
line. No torch.
"""

from __future__ import annotations

import signal
from typing import Callable

from workbench import runs
from workbench.launch import process

__all__ = ["follow_in_terminal"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def follow_in_terminal(handle: process.RunHandle, *, name: str, follow: Callable[[], runs.RunStatus],
                       say: Callable[[str], None]) -> int:
    """Run ``follow()`` (the command's progress display; it returns the final RunStatus) with the
    stop signals ending the run. Returns the command's exit status: 0 done, 1 failed, 3 stopped
    from elsewhere, 128 + the signal's number when a signal stopped it."""

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        raise _Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        st = follow()
    except _Interrupted as e:
        for s in old:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the stop
        st = process.stop(handle)
        say(f"workbench {name}: {e} received; run {handle.run_dir} {st.state}")
        return 128 + e.signum
    finally:
        for s, h in old.items():
            if signal.getsignal(s) is on_signal:
                signal.signal(s, h)
    if st.state == "done":
        return 0
    for line in st.log_tail[-10:]:
        say(f"  | {line}")
    err = str(st.error or f"the run ended {st.state}").splitlines()[0]
    say(f"workbench {name}: error: {err} (run {handle.run_dir}; log {handle.run.file(runs.LOG_FILE)})")
    return 1 if st.state == "failed" else 3
