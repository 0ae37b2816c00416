"""How the planners run OR-Tools' CP-SAT: workers, limits, cancellation, and what its log says.

Every CP-SAT model of the solver (one micro-step, ``microstep.cpsat_step``; the whole step,
``stack.solve_stack``) is solved through ``run_cpsat``: at most 2 workers (the
planning machines are small and shared, and notebook panels call planners from background threads),
``random_seed`` from the plan's seed, a cancel token checked at every solution, and the solution
hint's fate read from CP-SAT's own log.

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

def run_cpsat(model, *, time_limit: float, seed: int = 0, workers: int = 2, opts=None, presolve: bool = True):
    """Solve a CP-SAT ``model`` within ``time_limit`` seconds on at most 2 workers (small shared
    machines, planners on background threads); ``random_seed`` is ``seed``. Returns
    ``(solver, status, {"status", "wall_s", "hint"})``, where ``hint`` is what CP-SAT's log says
    of the model's solution hint ("complete, feasible", "complete, infeasible", or "partial or
    none"). ``presolve=False`` skips CP-SAT's presolve (a complete hint is then the first solution at
    once, where presolving can take a short limit's whole time). Raises Cancelled when ``opts``'
    cancel token is set during the search."""
    from ortools.sat.python import cp_model

    from workbench.solve.options import Cancelled

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, min(2, int(workers)))
    solver.parameters.random_seed = int(seed) % (2**31)
    solver.parameters.max_time_in_seconds = max(0.001, float(time_limit))
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
    return solver, status, {"status": solver.StatusName(status), "wall_s": float(solver.WallTime()), "hint": hint[0]}

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
