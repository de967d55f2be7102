"""`pytest -m "not integration"` runs exactly the unit tests: every module outside tests/unit that
starts engines, actors or trainers carries the integration marker (tests/gpu too)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_module_outside_unit_is_marked_integration():
    unmarked = [
        str(path.relative_to(TESTS))
        for folder in ("integration", "gpu")
        for path in sorted((TESTS / folder).glob("test_*.py"))
        if "pytest.mark.integration" not in path.read_text()
    ]
    assert unmarked == [], f"add `pytestmark = pytest.mark.integration` to {unmarked}"


def test_no_unit_module_is_marked_integration():
    marked = [
        path.name
        for path in sorted((TESTS / "unit").glob("test_*.py"))
        if path.name != Path(__file__).name and "pytest.mark.integration" in path.read_text()
    ]
    assert marked == [], f"{marked} start heavy processes: move them to tests/integration"
