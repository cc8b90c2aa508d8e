"""A config reload that removes many workers at once, with a large session table.

(Run as a module: as a script, ``bench/policies.py`` would shadow the ``policies`` package.)

Measured through the real ``WorkerRegistry.reconfigure`` and the gateway's ``_Housekeeper``
listener (``mesh.gateway.app``): ``new`` is the listener as shipped (one ``on_workers_removed`` call, one
pass over the table, the order rebuilt once when a large share goes); the peer ``per_worker`` is
the previous behaviour, measured in the same run: one ``unbind_targets`` pass per removed worker,
each unbinding its sessions one by one.

    python -m bench.bulk_unbind [--sessions 1000000] [--workers 200] [--remove 100] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.table import Table
from sortedcontainers import SortedList

from mesh.cluster.registry import Worker, WorkerRegistry
from mesh.config import parse_config
from mesh.core.sessions import SessionTable
from mesh.gateway.app import _Housekeeper


def config(names: list[str]) -> Any:
    return parse_config({"workers": [{"name": n, "url": f"http://127.0.0.1:{10000 + int(n[1:])}", "models": ["m"]}
                                     for n in names]})


def filled(n: int, targets: list[str]) -> SessionTable:
    """A table of ``n`` bindings spread over ``targets``, built directly (as ``bind`` leaves it:
    same invariants; binding 1M sessions one by one would dominate the run)."""
    table = SessionTable(idle_ttl_s=3600.0, max_sessions=n)
    table._bindings = {f"s{i}": (targets[i % len(targets)], float(i), i) for i in range(n)}
    table._order = SortedList((float(i), i, f"s{i}") for i in range(n))
    table._counts = {t: n // len(targets) + (1 if i < n % len(targets) else 0) for i, t in enumerate(targets)}
    table._seq = n
    return table


class PerWorker(_Housekeeper):
    """The listener before the change: one table pass per removed worker."""

    def on_workers_removed(self, workers: list[Worker]) -> None:
        for w in workers:
            super().on_workers_removed([w])


def run(kind: str, sessions: int, workers: int, remove: int) -> dict[str, Any]:
    names = [f"w{i}" for i in range(workers)]
    reg = WorkerRegistry(config(names))
    reg.reconfigure(config(names))
    table = filled(sessions, names)
    listener = (_Housekeeper if kind == "new" else PerWorker)(SimpleNamespace(index=None, sessions=table))  # type: ignore[arg-type]
    reg.add_listener(listener)
    keep = names[remove:]
    start = time.perf_counter()
    reg.reconfigure(config(keep))
    seconds = time.perf_counter() - start
    expected = sum(1 for i in range(sessions) if i % workers >= remove)
    if len(table) != expected or sorted(reg.workers) != sorted(keep):
        raise RuntimeError(f"{kind}: {len(table)} sessions left, expected {expected}")
    return {"kind": kind, "seconds": seconds, "scans": table.scans, "left": len(table)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=200)
    ap.add_argument("--remove", type=int, default=100)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "bulk_unbind.json")
    args = ap.parse_args()
    console = Console()
    rows = []
    for kind in ("per_worker", "new"):
        with console.status(f"{kind}: {args.sessions:,} sessions, removing {args.remove} of {args.workers} workers"):
            rows.append(run(kind, args.sessions, args.workers, args.remove))
    table = Table(title=f"reload removing {args.remove} of {args.workers} workers, {args.sessions:,} sessions")
    for col in ("listener", "seconds", "table passes", "sessions left", "vs per_worker"):
        table.add_column(col, justify="right")
    base = rows[0]["seconds"]
    for r in rows:
        table.add_row(r["kind"], f"{r['seconds']:.2f}", str(r["scans"]), f"{r['left']:,}", f"{base / r['seconds']:.1f}x")
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
