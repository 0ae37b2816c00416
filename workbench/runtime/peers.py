"""Which node went away: heartbeats of every rank through the rendezvous store, and the checks
that every node runs the same run.

A rank of a run over several nodes sees a peer's death only as a collective that fails ("connection
closed by peer") or, when the peer's machine vanished without closing its sockets, one that waits
until the collective timeout. Neither names the node. :class:`PeerWatch` keeps a counter per rank
in torchrun's store (node 0 hosts it) that a thread of every rank advances once a second; after a
failure a rank reads the counters twice, a few seconds apart, and the ranks whose counters stood
still (and that did not say they ended) are gone: it names their node and host (while only part of
a node is still, it watches a few windows more: a node's ranks die one after another). When the store
itself stops answering, node 0 (which hosts it) is the one gone. The watch thread can also end its
rank when a peer has been silent for ``stall_s`` seconds, instead of waiting in a collective until
the timeout.

``workbench.launch.cluster.node_problem`` (re-exported here) compares what every rank reports at
start (its node, host, processes on its node, run id and spec) and says in one line what differs
between the nodes: another ``--nproc``, another run, another spec.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Mapping, Sequence

from workbench.launch.cluster import node_problem, rank_ranges, spec_differences

__all__ = ["PeerWatch", "node_problem", "rank_ranges", "spec_differences", "store_from_env"]


class PeerWatch:
    """Heartbeats of every rank in ``store`` (a torch.distributed Store), to name ranks that are gone.

    ``members[r] = (node, host)`` for every rank; ``interval`` s between beats. ``on_stall`` (called
    from the watch thread with a one-line diagnosis) when a peer has not beaten for ``stall_s``
    seconds (None: never). The store's own operations must not block forever: give it a timeout."""

    def __init__(self, store, rank: int, members: Mapping[int, tuple[int, str]], *, interval: float = 1.0,
                 stall_s: float | None = None, on_stall: Callable[[str], None] | None = None,
                 store_host: str = "node 0") -> None:
        self.store = store
        self.rank = int(rank)
        self.members = {int(r): (int(n), str(h)) for r, (n, h) in members.items()}
        self.interval = float(interval)
        self.stall_s = stall_s
        self.on_stall = on_stall
        self.store_host = store_host
        self.store_lost: str | None = None
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}
        self._thread: threading.Thread | None = None

    # ---- the store ----------------------------------------------------------------------------
    def _beat(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)

    def counters(self) -> dict[int, int]:
        """Every rank's beat counter (``add(key, 0)`` reads without changing it)."""
        return {r: int(self.store.add(f"beat/{r}", 0)) for r in self.members}

    def ended(self) -> set[int]:
        """Ranks that said they ended (done or failed), so their silence is not a loss."""
        return {r for r in self.members if self.store.check([f"end/{r}"])}

    def mark_ended(self, how: str) -> None:
        """Say this rank ends (``done`` or ``failed``); never raises."""
        try:
            self.store.set(f"end/{self.rank}", how)
        except Exception:  # noqa: BLE001 - the store may be gone with node 0
            pass

    # ---- the thread ----------------------------------------------------------------------------
    def start(self) -> "PeerWatch":
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="peer-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                if self.stall_s is not None:
                    self._check_stall()
            except Exception as e:  # noqa: BLE001 - a store that stopped answering is a finding, not a crash
                self.store_lost = str(e).splitlines()[0] if str(e) else type(e).__name__
                if self.stall_s is not None and self.on_stall is not None and not self._stop.is_set():
                    self._stop.set()
                    self.on_stall(self._store_gone())
                return

    def _check_stall(self) -> None:
        now = time.monotonic()
        counts = self.counters()
        for r, c in counts.items():
            last = self._seen.get(r)
            if last is None or last[0] != c:
                self._seen[r] = (c, now)
        quiet = [r for r, (_, t) in self._seen.items() if r != self.rank and now - t > self.stall_s]
        if quiet:
            quiet = [r for r in quiet if r not in self.ended()]
        if quiet and self.on_stall is not None and not self._stop.is_set():
            self._stop.set()
            self.on_stall(self.describe(quiet, f"silent for over {self.stall_s:.0f} s"))

    # ---- diagnosis -----------------------------------------------------------------------------
    def _store_gone(self) -> str:
        hosts = sorted({h for n, h in self.members.values() if n == 0})
        return (f"node 0 ({', '.join(hosts) or '?'}) is gone: the rendezvous store it hosts ({self.store_host}) stopped "
                f"answering ({self.store_lost})")

    def describe(self, ranks: Sequence[int], how: str = "stopped answering (its processes are gone)") -> str:
        """One line naming the nodes (and hosts and ranks) of ``ranks``."""
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.members.get(r, (-1, "?"))[0], []).append(r)
        parts = []
        for n, rs in sorted(by_node.items()):
            host = self.members.get(rs[0], (n, "?"))[1]
            whole = sorted(r for r, (m, _) in self.members.items() if m == n) == sorted(rs)
            what = f"node {n} ({host}, rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)})"
            parts.append(what if whole else what.replace(f"node {n} (", f"part of node {n} ("))
        return f"{' and '.join(parts)} {how}"

    def diagnose(self, wait: float = 3.0, settle: int = 3) -> str | None:
        """After a failed collective: which ranks are gone (their counters stood still for ``wait``
        seconds and they did not say they ended), as one line naming their nodes; the store's own
        loss names node 0; None when every peer is alive. Where the gone ranks are part of a node, up
        to ``settle`` more windows are watched: a node's processes die one after another when its
        agent or machine goes (a rank can outlive its killed agent by seconds), and the line names
        the ranks still gone at the end."""
        if self.store_lost:
            return self._store_gone()
        try:
            gone = self._still(wait)
            for _ in range(settle):
                if not gone or not self._part_of_a_node(gone):
                    break
                gone = self._still(wait)
        except Exception as e:  # noqa: BLE001
            self.store_lost = str(e).splitlines()[0] if str(e) else type(e).__name__
            return self._store_gone()
        return self.describe(gone) if gone else None

    def _still(self, wait: float) -> list[int]:
        """The other ranks whose counters stand still over ``wait`` seconds and that did not say they ended."""
        before = self.counters()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        after = self.counters()
        ended = self.ended()
        return [r for r in self.members if r != self.rank and after.get(r) == before.get(r) and r not in ended]

    def _part_of_a_node(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` hold some but not all of a node's other ranks."""
        nodes = {self.members[r][0] for r in ranks}
        mine = set(ranks)
        return any(not {r for r, (m, _) in self.members.items() if m == n and r != self.rank} <= mine for n in nodes)


def store_from_env(timeout_s: float = 10.0):
    """``(store, "host:port")``: a client of torchrun's store (``MASTER_ADDR``/``MASTER_PORT``: the
    agent's store on node 0) under a prefix of its own, or None when the environment names none."""
    import datetime

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"workbench/peers/{run}/{restart}", store), f"{addr}:{port}"
