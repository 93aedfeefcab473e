"""The MPI tag registry (`rlx_mpi.tags`): every tag within the standard's 32,767, no two uses
overlapping, and no module outside the registry choosing a tag number of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rlx_mpi import tags

PKG = Path(__file__).resolve().parent.parent / "rlx_mpi"


def test_every_tag_is_at_most_the_guaranteed_bound_and_no_two_overlap():
    spans = sorted((first, first + size - 1, name) for name, (first, size) in tags.RANGES.items())
    assert spans[0][0] >= 0 and spans[-1][1] <= tags.TAG_UB == 32_767
    for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
        assert hi < lo, f"{a} and {b} overlap"


def test_an_index_past_its_range_is_named():
    assert tags.in_range(tags.GROUP_HIDDEN, 3, "group") == 11_003
    with pytest.raises(ValueError, match="group: index 10000 is outside"):
        tags.in_range(tags.GROUP_HIDDEN, 10_000, "group")


def _tag_literals(path: Path) -> list[str]:
    """``tag=<int>`` keywords and names with a TAG word (``_TAG_X``) bound to a literal, outside tags.py."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg in ("tag", "tag_base") and isinstance(node.value, ast.Constant):
            found.append(f"{path.name}:{node.lineno} tag={node.value.value}")
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.Tuple)):
            for t in node.targets:
                names = [t] if isinstance(t, ast.Name) else list(getattr(t, "elts", []))
                for n in names:
                    if isinstance(n, ast.Name) and re.search(r"(^|_)TAG(_|$)", n.id.upper()):
                        found.append(f"{path.name}:{node.lineno} {n.id}")
    return found


def test_no_module_but_the_registry_picks_a_tag_number():
    found = [f for p in PKG.rglob("*.py") if p.name != "tags.py" for f in _tag_literals(p)]
    assert found == []


def test_the_check_sees_a_literal_tag(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text("_TAG_X = 50_000\ndef f(c):\n    c.Isend(b, dest=0, tag=7)\n")
    assert _tag_literals(planted) == ["m.py:1 _TAG_X", "m.py:3 tag=7"]
