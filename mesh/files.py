"""Reading a user-named file safely: a regular file only, bounded, never blocking.

Config files, traces and timing profiles are named by users. A FIFO opened for reading blocks until
a writer comes (a config reload runs on the gateway's event loop: the whole gateway would hang), a
device such as /dev/zero never ends, and a file can be larger than memory. ``read_regular_file``
opens without blocking, checks what the descriptor is (no race with a file swapped after a check
by name), and reads at most ``max_bytes``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class FileProblem(ValueError):
    """Why a file cannot be read, in words for the user (the caller adds which file)."""


def read_regular_file(path: str | Path, max_bytes: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FileProblem("no such file") from None
    except IsADirectoryError:
        raise FileProblem("is a directory") from None
    except OSError as exc:
        raise FileProblem(f"cannot read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise FileProblem("is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem("not a regular file (a FIFO or a device)")
        if st.st_size > max_bytes:
            raise FileProblem(f"{st.st_size:,} bytes, over the limit of {max_bytes:,}")
        try:
            raw = f.read(max_bytes + 1)
        except OSError as exc:
            raise FileProblem(f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:  # grew while being read
        raise FileProblem(f"over the limit of {max_bytes:,} bytes")
    return raw
