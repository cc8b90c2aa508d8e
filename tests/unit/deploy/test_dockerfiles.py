"""The Dockerfiles checked without Docker (no daemon here: nothing below claims an image builds).

What can be checked statically: every COPY source exists and the build context (.dockerignore)
keeps it; the images run the commands and flags the CLI has (parsed by ``mesh``'s own parser);
the exposed ports and HEALTHCHECK agree with the config the image carries; the user is not root;
the gateway image installs the project without torch, the worker image with the `engine` extra
on a CUDA base it names.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from mesh.cli import build_parser
from mesh.config import load_config

ROOT = Path(__file__).resolve().parents[3]
GATEWAY = ROOT / "Dockerfile"
WORKER = ROOT / "deploy" / "docker" / "worker.Dockerfile"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)]


def args_of(path: Path, name: str) -> list[str]:
    return [a for i, a in instructions(path) if i == name]


def exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{text} is not the exec form"
    return value


def context_keeps(rel: str) -> bool:
    """Whether .dockerignore (an allowlist: `*` then `!path` lines) keeps ``rel`` in the context."""
    kept = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(rel, pattern) or rel.startswith(pattern + "/") or fnmatch.fnmatch(rel, pattern.replace("**/", "")):
            kept = negate
    return kept


@pytest.mark.parametrize("dockerfile", [GATEWAY, WORKER], ids=["gateway", "worker"])
def test_every_copy_source_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    copies = [shlex.split(a) for a in args_of(dockerfile, "COPY")]
    assert copies
    for parts in copies:
        if any(p.startswith("--from=") for p in parts):
            continue  # from a build stage, not the context
        for src in [p for p in parts if not p.startswith("--")][:-1]:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such path"
            assert context_keeps(src), f"{dockerfile.name}: COPY {src}: excluded by .dockerignore"
    assert not context_keeps(".venv") and not context_keeps(".git") and not context_keeps("tests")
    assert not context_keeps("mesh/__pycache__")


@pytest.mark.parametrize("dockerfile", [GATEWAY, WORKER], ids=["gateway", "worker"])
def test_the_image_runs_as_a_non_root_user(dockerfile: Path) -> None:
    users = args_of(dockerfile, "USER")
    assert users and users[-1] not in ("root", "0"), users
    assert any(f"--uid {users[-1]}" in run for run in args_of(dockerfile, "RUN"))


def test_gateway_image_serves_the_config_it_carries_on_the_port_it_exposes() -> None:
    entry, cmd = exec_form(args_of(GATEWAY, "ENTRYPOINT")[-1]), exec_form(args_of(GATEWAY, "CMD")[-1])
    assert entry == ["mesh"]
    args = build_parser().parse_args(cmd)  # the command and its flags exist (argparse exits on an unknown one)
    assert args.command == "serve" and args.config == "/etc/mesh/mesh.yaml"
    copied = {shlex.split(a)[-1]: shlex.split(a)[0] for a in args_of(GATEWAY, "COPY")}
    config = load_config(ROOT / copied[args.config])  # the image's default config, by mesh's own loader
    assert config.server.host == "0.0.0.0"  # reachable from outside the container
    assert args_of(GATEWAY, "EXPOSE") == [str(config.server.port)]
    health = args_of(GATEWAY, "HEALTHCHECK")[-1]
    assert f"http://127.0.0.1:{config.server.port}/health" in health


def test_gateway_image_installs_the_project_without_torch() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith("torch") for d in deps)  # the base install has no torch
    runs = " ".join(args_of(GATEWAY, "RUN"))
    assert "[engine]" not in runs and "torch" not in runs
    assert re.search(r"FROM \$\{PYTHON_IMAGE\}|FROM python:", GATEWAY.read_text())
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.1[1-9][\w.-]*-slim", GATEWAY.read_text())


def test_worker_image_names_its_cuda_base_and_runs_the_worker_with_its_kv_events_bound() -> None:
    text = WORKER.read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M)
    assert base and base.group(1).startswith("nvidia/cuda:") and base.group(1) in text.split("ARG CUDA_IMAGE")[0]
    assert 'pip install --no-cache-dir ".[engine]"' in text
    assert "engine" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    entry, cmd = exec_form(args_of(WORKER, "ENTRYPOINT")[-1]), exec_form(args_of(WORKER, "CMD")[-1])
    assert entry == ["mesh", "worker"]
    args = build_parser().parse_args(entry[1:] + cmd)
    assert args.host == "0.0.0.0" and args.kv_events_endpoint.startswith("tcp://*:")
    ports = {args.port, int(args.kv_events_endpoint.rpartition(":")[2])}
    assert set(map(int, args_of(WORKER, "EXPOSE")[-1].split())) == ports
    assert f"http://127.0.0.1:{args.port}/health" in args_of(WORKER, "HEALTHCHECK")[-1]
