"""Issue #47: the losses' formula table lives once, in docs/specification.md §5, and names every
option of ``LossConfig`` that changes a formula; the modules point to it (two copies, in
``losses.py`` and ``kernels/reference.py``, had drifted: the reference's lacked ``kl_mask`` and
``kl_to``)."""

from __future__ import annotations

import typing
from pathlib import Path

from offpolicy.core.config import LossConfig

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "specification.md"


def _section_5() -> str:
    text = SPEC.read_text()
    start = text.index("## §5 ")
    return text[start:text.index("\n## ", start + 1)]


def _literals(field: str) -> tuple[str, ...]:
    """The string values of a Literal field (an optional one: of the Literal inside)."""
    out: list[str] = []
    for arg in typing.get_args(LossConfig.model_fields[field].annotation):
        out.extend(typing.get_args(arg) or ([arg] if isinstance(arg, str) else []))
    return tuple(out)


def test_the_table_names_every_option_that_changes_a_formula():
    table = _section_5()
    for field in ("kind", "agg", "kl_mask", "kl_to", "gspo_form", "sapo_level", "score_centering"):
        values = _literals(field)
        assert values, field
        missing = [v for v in values if v not in table]
        assert not missing, f"docs/specification.md §5 does not name {field} {missing}"
    for word in ("kl_is_weight", "global_tokens", "global_seqs", "denominator", "max_len", "ratio_value_cap"):
        assert word in table, word


def test_the_table_is_written_once():
    """A row of the table (its own wording) appears in docs/specification.md alone; the modules cite it."""
    rows = ("mean over non-empty rows of Σ_t ℓ / max_len", "ℓ = −(4/τ)·σ(τ(r−1))·A")
    holders = [p for p in [SPEC, *(ROOT / "src").rglob("*.py")] if any(row in p.read_text() for row in rows)]
    assert holders == [SPEC], holders
    for module in ("losses.py", "kernels/reference.py"):
        assert "docs/specification.md §5" in (ROOT / "src" / "offpolicy" / "core" / module).read_text(), module
