"""The pinned upstream engines' own code for the tests that run it (``tests/e2e/upstream``).

The wheels are fetched with ``pip download --no-deps`` into a cache directory (``MESH_UPSTREAM_CACHE``,
default ``~/.cache/mesh-upstream``) and reused while present; only their Python modules are
extracted there (zipfile), once per version. Nothing of theirs is in the repository. The pins can
be overridden (``MESH_UPSTREAM_VLLM``, ``MESH_UPSTREAM_SGLANG``) to check a newer release.
A failed download fails the calling test with pip's reason: nothing here skips.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

# The versions this repository is verified against (README.md, "Tests against upstream code").
PINS = {"vllm": "0.33.0", "sglang": "0.5.23"}
_ENV = {"vllm": "MESH_UPSTREAM_VLLM", "sglang": "MESH_UPSTREAM_SGLANG"}


@dataclass(frozen=True)
class Upstream:
    name: str
    version: str
    wheel: Path
    root: Path  # holds the extracted package: put it on sys.path


def cache_dir() -> Path:
    return Path(os.environ.get("MESH_UPSTREAM_CACHE", Path.home() / ".cache" / "mesh-upstream"))


def version(name: str) -> str:
    return os.environ.get(_ENV[name]) or PINS[name]


def _wheel(name: str, ver: str, cache: Path) -> Path:
    wheels = sorted((cache / "wheels").glob(f"{name}-{ver}-*.whl"))
    if wheels:
        return wheels[0]
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(cache / "wheels"), f"{name}=={ver}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wheels = sorted((cache / "wheels").glob(f"{name}-{ver}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {name}=={ver} ({' '.join(cmd)}): exit {done.returncode}\n"
                           f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return wheels[0]


def fetch(name: str) -> Upstream:
    """The wheel of ``name`` at its pinned (or overridden) version, its Python modules extracted."""
    ver = version(name)
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{name}.lock", "w") as lock:  # parallel test processes fetch one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        wheel = _wheel(name, ver, cache)
        root = cache / "src" / f"{name}-{ver}"
        if not root.is_dir():  # extracted beside it, then renamed: never seen half done
            tmp = cache / "src" / f".{name}-{ver}.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            with zipfile.ZipFile(wheel) as zf:
                for member in zf.namelist():
                    if member.startswith(f"{name}/") and member.endswith(".py"):
                        zf.extract(member, tmp)
            tmp.rename(root)
    return Upstream(name, ver, wheel, root)
