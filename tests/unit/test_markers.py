"""The test tree's layout: `pytest -m "not integration"` runs exactly the unit tests: every module outside tests/unit that
starts engines, actors or trainers carries the integration marker (tests/gpu too)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_module_outside_unit_is_marked_integration():
    unmarked = [
        str(path.relative_to(TESTS))
        for folder in ("integration", "gpu")
        for path in sorted((TESTS / folder).rglob("test_*.py"))
        if "pytest.mark.integration" not in path.read_text()
    ]
    assert unmarked == [], f"add `pytestmark = pytest.mark.integration` to {unmarked}"


def test_no_unit_module_is_marked_integration():
    marked = [
        path.name
        for path in sorted((TESTS / "unit").rglob("test_*.py"))
        if path.name != Path(__file__).name and "pytest.mark.integration" in path.read_text()
    ]
    assert marked == [], f"{marked} start heavy processes: move them to tests/integration"


def test_each_unit_folder_is_named_after_a_package_of_forge_rl():
    """tests/unit mirrors the package: a module's tests live in the folder of its package (those of
    the top-level modules and of the package as a whole at tests/unit itself)."""
    packages = {path.parent.name for path in (TESTS.parent / "forge_rl").glob("*/__init__.py")}
    folders = {path.parent.name for path in (TESTS / "unit").glob("*/__init__.py")}
    assert folders - packages == set(), f"tests/unit folders {sorted(folders - packages)} name no package of forge_rl"
