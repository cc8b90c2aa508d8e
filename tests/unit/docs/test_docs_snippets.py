"""The docs cannot drift from the config schema: every ```yaml block of README.md and docs/*.md
that is a Mesh config (a mapping with a top-level section such as `workers:`, `server:`,
`policy:`, `sessions:` or `state:`) loads with ``mesh.config.parse_config`` (policy built), and
every relative Markdown link there resolves.

YAML's duplicate keys are refused here: PyYAML keeps the last one silently, so a block with three
`policy:` lines would validate as its last line alone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mesh.config import MeshConfig, parse_config

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```yaml[ \t]*\n(.*?)^```", re.S | re.M)
SECTIONS = frozenset(MeshConfig.model_fields)  # server, workers, policy, sessions, state, ...


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice (instead of keeping the last)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def yaml_blocks(path: Path) -> list[tuple[str, str]]:
    """(``file:line``, text) of every ```yaml block in ``path``."""
    text = path.read_text()
    return [(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1))
            for m in FENCE.finditer(text)]


def config_snippets() -> list[tuple[str, Any]]:
    out = []
    for path in DOCS:
        for where, block in yaml_blocks(path):
            data = yaml.load(block, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
            if isinstance(data, dict) and SECTIONS & set(data):
                out.append((where, data))
    return out


SNIPPETS = config_snippets()


def test_the_docs_hold_the_config_snippets_this_test_is_meant_to_guard() -> None:
    where = {w.split(":")[0] for w, _ in SNIPPETS}
    assert {"README.md", "docs/policies.md"} <= where, where
    assert len(SNIPPETS) >= 3, SNIPPETS


@pytest.mark.parametrize(("where", "data"), SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_every_config_snippet_in_the_docs_validates(where: str, data: Any) -> None:
    config = parse_config(data, where)  # raises ConfigError naming the YAML path of each problem
    assert set(data) <= SECTIONS, f"{where}: unknown top-level sections {sorted(set(data) - SECTIONS)}"
    assert isinstance(config, MeshConfig)


def test_the_strict_loader_refuses_a_key_given_twice() -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'policy'"):
        yaml.load("policy: round_robin\npolicy: random\n", Loader=_StrictLoader)  # noqa: S506


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_in_the_docs_resolve(path: Path) -> None:
    text = FENCE.sub("", path.read_text())
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    # Links out of the repository (../shared/DESIGN.md: the workspace's design notes) are not
    # part of a checkout; every link inside it must resolve.
    inside = [t for t in targets if (path.parent / t).resolve().is_relative_to(ROOT)]
    missing = [t for t in inside if not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files {missing}"
