"""How the planners run OR-Tools' CP-SAT: workers, limits, cancellation, and what its log says.

Every CP-SAT model of the solver (one micro-step, ``microstep.cpsat_step``; the whole step,
``stack.solve_stack``; two-stage's packing) is solved through ``run_cpsat``: on a deterministic-time
budget taken from the plan's effort (``workbench.solve.effort``), at most 2 workers (the planning
machines are small and shared, and notebook panels call planners from background threads) with
their search interleaved so that the answer does not depend on the threads' timing, ``random_seed``
from the plan's seed, a cancel token checked at every solution, and the solution hint's fate read
from CP-SAT's own log.

Pure Python + OR-Tools; no torch.
"""

from __future__ import annotations

__all__ = ["run_cpsat", "CancelCallback", "CPSAT_WORKERS", "warm_up"]

CPSAT_WORKERS = 2
"""CP-SAT search workers (at most 2: small shared machines, planners on background threads)."""

HINT_MESSAGES = (
    ("The solution hint is complete and is feasible", "complete, feasible"),
    ("The solution hint is complete, but it is infeasible", "complete, infeasible"),
    ("The solution hint is complete", "complete"),
)

def run_cpsat(model, *, effort: float, clock, seed: int = 0, workers: int = CPSAT_WORKERS, opts=None,
              presolve: bool = True):
    """Solve a CP-SAT ``model`` on ``effort`` reference seconds of the plan's ``clock``
    (``workbench.solve.effort.Effort``), deterministically: a deterministic-time limit, at most 2
    workers whose search is interleaved (CP-SAT's ``interleave_search``: the same answer whatever the
    threads' timing), ``random_seed`` from ``seed``; the clock is charged the deterministic time used.
    The wall clock bounds the call only through the clock's safety cap. ``presolve=False`` skips
    CP-SAT's presolve (a complete hint is then the first solution at once, where presolving can take a
    small budget's whole effort).

    Returns ``(solver, status, {"status", "dtime", "wall_s", "hint"})``: ``dtime`` the deterministic
    time used, ``wall_s`` the measured seconds (for the plan's ``stats["wall"]`` only), ``hint`` what
    CP-SAT's log says of the model's solution hint ("complete, feasible", "complete, infeasible", or
    "partial or none"). Raises Cancelled when ``opts``' cancel token is set during the search."""
    from ortools.sat.python import cp_model

    from workbench.solve.options import Cancelled

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, min(2, int(workers)))
    solver.parameters.interleave_search = True
    solver.parameters.interleave_batch_size = 2  # larger batches overrun the deterministic-time limit
    solver.parameters.random_seed = int(seed) % (2**31)
    solver.parameters.max_deterministic_time = max(1e-4, clock.cpsat_dtime(effort))
    wall = clock.wall_left_s()
    if wall != float("inf"):
        solver.parameters.max_time_in_seconds = max(0.001, wall)
    solver.parameters.cp_model_presolve = bool(presolve)
    # the log is parsed for what CP-SAT says of the hint; it is not printed
    solver.parameters.log_search_progress = True
    solver.parameters.log_to_stdout = False
    hint = ["partial or none"]

    def on_log(line: str) -> None:
        if hint[0] == "partial or none" and "solution hint" in line:
            for needle, label in HINT_MESSAGES:
                if needle in line:
                    hint[0] = label
                    break

    solver.log_callback = on_log
    cb = CancelCallback(opts)
    status = solver.Solve(model, cb)
    if cb.cancelled:
        raise Cancelled("planning was cancelled")
    dtime = float(solver.response_proto.deterministic_time)
    clock.charge_cpsat(dtime)
    return solver, status, {"status": solver.StatusName(status), "dtime": round(dtime, 9),
                            "wall_s": float(solver.WallTime()), "hint": hint[0]}


class CancelCallback:
    """CP-SAT solution callback that stops the search when ``opts``' cancel token is set (its
    ``cancelled`` says whether it did)."""

    def __new__(cls, opts):
        from ortools.sat.python import cp_model

        class _CB(cp_model.CpSolverSolutionCallback):
            def __init__(self):
                super().__init__()
                self.cancelled = False

            def on_solution_callback(self):
                if opts is not None and opts.cancel is not None and opts.cancel.is_set():
                    self.cancelled = True
                    self.stop_search()

        return _CB()


def warm_up() -> None:
    """Import OR-Tools' CP-SAT (about 0.6 s, once per process) so that it is not charged to the
    first plan's time limit. PlanAhead's worker calls it when it starts."""
    from ortools.sat.python import cp_model  # noqa: F401
