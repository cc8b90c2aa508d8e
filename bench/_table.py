"""One table printer for the benchmarks (rich when importable, plain text otherwise: some GPU
images run the benches without the project's dependencies)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def print_table(title: str, headers: Sequence[str], rows: Iterable[Sequence[str]], *, width: int = 150,
                left: Iterable[str] = ()) -> None:
    """Columns right-aligned except those named in ``left``."""
    rows = [list(r) for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(headers))
        for r in rows:
            print(" | ".join(r))
        return
    left = set(left)
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h in left else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=width).print(table)
