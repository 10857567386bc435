"""The docs name the same contracts the code defines: metric names, annotation keys, reason codes, the API group.

A renamed metric or reason code must fail here until the README, the operations guide, the runbooks and the
architecture notes say the new name, so a person following the docs never greps for a name that no longer exists.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from controller.observe.metrics import series_names
from controller.rules import contracts as c

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "charts" / "sandkeep" / "README.md"]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_metric_a_doc_names_is_exported(doc: Path) -> None:
    named = set(re.findall(r"\bsandkeep_[a-z_]+[a-z]\b", _text(doc)))
    unknown = sorted(n for n in named if n not in series_names() and not n.startswith("sandkeep_io"))
    assert not unknown, f"{doc.name} names metrics the code does not export: {unknown}"


def test_the_operations_guide_lists_every_exported_metric() -> None:
    # The metrics table is in docs/operations.md ("Metrics"); the README links to it.
    guide = _text(REPO / "docs" / "operations.md")
    metric_names = [v for k, v in vars(c).items() if k.startswith("M_")]
    missing = [n for n in metric_names if f"`{n}`" not in guide]
    assert not missing, f"docs/operations.md's metrics table lacks {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_annotation_key_a_doc_names_is_a_contract(doc: Path) -> None:
    keys = {v for k, v in vars(c).items() if k.startswith("ANN_")} | {c.FINALIZER}
    named = set(re.findall(rf"(?<![.\w]){re.escape(c.GROUP)}/[a-z-]+[a-z]", _text(doc)))  # not kind.group/name
    unknown = sorted(named - keys - {f"{c.GROUP}/{c.VERSION}"} - {c.LABEL_NODE})
    assert not unknown, f"{doc.name} names {c.GROUP} keys the code does not define: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_reason_code_a_doc_names_is_a_reason(doc: Path) -> None:
    codes = {r.value for r in c.Reason}
    named = set(re.findall(r"\breason[=:] ?`?\"?([A-Z][A-Za-z]+)", _text(doc)))
    unknown = sorted(named - codes - {p.value for p in c.Phase})
    assert not unknown, f"{doc.name} names reason codes the code does not define: {unknown}"


def test_the_docs_use_the_api_group_and_short_name_the_crd_serves() -> None:
    readme = _text(REPO / "README.md")
    assert f"kubectl get {c.SANDBOX_SHORT} -A" in readme
    assert c.ANN_PIN_FOR in readme and c.ANN_PIN_UNTIL in readme and c.FINALIZER in readme


def test_the_module_map_names_every_module_and_no_module_that_is_gone() -> None:
    # Issue 26: the package is in layers; docs/development.md's map is how a person finds a file: it follows every move.
    devdoc = _text(REPO / "docs" / "development.md")
    mapped = set(re.findall(r"^\| `([a-z_]+/[a-z_]+\.py)` \|", devdoc, flags=re.M))
    package = REPO / "controller"
    modules = {
        str(p.relative_to(package))
        for p in package.glob("*/*.py")
        if p.name != "__init__.py" and p.parent.name != "agent"
    }
    assert mapped == modules, (
        f"docs/development.md's module map lacks {sorted(modules - mapped)}, names gone {sorted(mapped - modules)}"
    )
    agent_row = next(line for line in devdoc.splitlines() if line.startswith("| `agent/` |"))
    unnamed = [
        p.name for p in (package / "agent").glob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in agent_row
    ]
    assert not unnamed, f"docs/development.md's agent/ row does not name {unnamed}"


def test_the_test_map_names_every_test_folder_and_no_folder_that_is_gone() -> None:
    # Issue 26, item 9: the tests are in folders by what they need; docs/development.md says which need what.
    devdoc = _text(REPO / "docs" / "development.md")
    mapped = set(re.findall(r"^\| `tests/([a-z_]+)/` \|", devdoc, flags=re.M))
    folders = {p.parent.name for p in (REPO / "tests").glob("*/__init__.py")}
    assert mapped == folders, (
        f"docs/development.md's test map lacks {sorted(folders - mapped)}, names gone {sorted(mapped - folders)}"
    )


def test_the_architecture_pictures_name_the_layers_in_order_and_only_modules_that_exist() -> None:
    # Issue 26, item 10: docs/architecture.md's pictures match the rooms: the layers picture lists them in the
    # order of import-linter's layers contract, and every `room/module.py` a picture names is there.
    text = _text(REPO / "docs" / "architecture.md")
    pictures = re.findall(r"^```\n(.*?)^```", text, flags=re.M | re.S)
    layers_picture = next(p for p in pictures if "controller/rules/" in p)
    drawn = re.findall(r"controller/([a-z]+)/", layers_picture)
    contract = tomllib.loads(_text(REPO / "pyproject.toml"))["tool"]["importlinter"]["contracts"]
    layers = next(k["layers"] for k in contract if k["type"] == "layers")
    expected = [room.strip().removeprefix("controller.") for layer in layers for room in layer.split("|")]
    assert drawn == expected, f"the layers picture draws {drawn}, the contract says {expected}"
    named = {m for picture in pictures for m in re.findall(r"\b([a-z]+/[a-z_]+\.py)\b", picture)}
    missing = sorted(m for m in named if not (REPO / "controller" / m).is_file())
    assert named and not missing, f"docs/architecture.md's pictures name modules that are gone: {missing}"
