"""Server-sent events as a client reads them off the wire, for tests of streamed answers."""

from __future__ import annotations


def sse_data(raw: bytes) -> list[str]:
    """The data of each SSE event (events end with a blank line; a line that is not a field is garbage)."""
    out = []
    for event in raw.decode().split("\n\n"):
        if not event:
            continue
        lines = event.split("\n")
        assert all(line.startswith("data: ") for line in lines), f"malformed event {event!r}"
        out.append("\n".join(line[6:] for line in lines))
    return out
