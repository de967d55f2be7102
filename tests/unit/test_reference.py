"""The generated references (forge_rl/reference.py): the committed pages are what the docstrings
give now, and a docstring's change makes a page stale."""

from __future__ import annotations

import dataclasses

from forge_rl import reference


@dataclasses.dataclass(frozen=True)
class _Inner:
    """An inner section."""

    rate: float = 0.5
    """How fast, per second."""


@dataclasses.dataclass(frozen=True)
class _Outer:
    name: str = "x"
    """The name."""
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    items: tuple[_Inner, ...] = ()
    maybe: _Inner | None = None


def test_the_committed_reference_pages_are_what_the_docstrings_give():
    assert reference.stale_pages() == [], "run `python -m forge_rl.reference` and commit docs/reference/"


def test_every_dataclass_under_a_config_is_a_section_with_its_fields_docstrings():
    sections = reference.config_sections(_Outer)
    assert [(s.prefix, s.optional, s.repeated) for s in sections] == [
        ("", False, False),
        ("inner", False, False),
        ("items[i]", False, True),
        ("maybe", True, False),
    ]
    assert sections[0].fields == (reference.Field("name", "str", "'x'", "The name."),)
    assert sections[1].doc == "An inner section."
    assert sections[1].fields == (reference.Field("inner.rate", "float", "0.5", "How fast, per second."),)


def test_a_page_that_differs_from_the_code_is_stale(tmp_path):
    reference.write_pages(tmp_path)
    assert reference.stale_pages(tmp_path) == []
    page = tmp_path / "configuration.md"
    page.write_text(page.read_text().replace("Trainer optimizer steps", "Optimizer steps"))
    (tmp_path / "metrics.md").unlink()
    assert reference.stale_pages(tmp_path) == [page, tmp_path / "metrics.md"]


def test_every_metric_name_has_a_meaning():
    metrics = reference.metric_names()
    assert len(metrics) > 50
    assert [m.constant for m in metrics if not m.doc] == []


def test_every_config_field_has_a_meaning():
    from forge_rl.config import GRPOConfig

    undocumented = [f.name for s in reference.config_sections(GRPOConfig) for f in s.fields if not f.doc]
    assert undocumented == []


def test_a_metrics_key_no_page_documents_is_found_and_patterns_cover_their_family():
    from tests.support.helpers import undocumented_metric_keys

    record = {
        "step": 1,
        "reward/components/format": 0.5,
        "weights/stall_s": 0.1,
        "buffer/trained_completion_len_p90": 4,
        "mismatch_kl/generator/0": 0.0,
        "made_up/key": 1,
    }
    assert undocumented_metric_keys([record]) == ["made_up/key"]
