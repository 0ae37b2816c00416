"""Process control for runs: start a supervised torchrun tree, poll it, stop it, find it again.

``process`` (no torch) is what notebooks, panels and the CLI call; ``supervisor`` is the process
it starts (torchrun itself, plus loopback rendezvous, per-rank logs, signal handling, and a sweep
that leaves no process behind); ``forked``, how its ranks start: as forks of it, torch imported once.
"""

from workbench.launch.process import RunBusy, RunHandle, attach, new_steps, poll, run_alive, start, stop, wait

__all__ = ["RunBusy", "RunHandle", "attach", "new_steps", "poll", "run_alive", "start", "stop", "wait"]
