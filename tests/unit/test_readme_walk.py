"""The README's request path and event path name files that exist, each step's first file
defining the function or class the step names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _steps(title: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split(title, 1)[1].split("\n\n", 2)[1]
    return [line for line in block.splitlines() if re.match(r"\d+\. ", line)]


def _check(title: str, minimum: int) -> None:
    steps = _steps(title)
    assert len(steps) >= minimum, steps
    for step in steps:
        paths = re.findall(r"`([\w/]+\.py)`", step)
        assert paths, step
        for path in paths:
            assert (ROOT / path).is_file(), f"{path} (README step {step!r}) does not exist"
        named = re.findall(r"`(\w+)(?:\.(\w+))?`", step.split(":", 1)[1] if ":" in step else "")
        source = (ROOT / paths[0]).read_text()
        for cls, method in named:
            assert re.search(rf"(class|def) {cls}\b", source) or not cls[0].isupper() or cls in source, (cls, paths[0])
            if method:
                assert re.search(rf"def {method}\b", source), (f"{cls}.{method}", paths[0])


def test_the_request_path_names_existing_files_in_order() -> None:
    _check("The request path, in the order a request takes it:", 8)


def test_the_event_path_names_existing_files_in_order() -> None:
    _check("The event path:", 5)
