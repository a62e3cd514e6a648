"""Each distribution of the monorepo names a README that exists and says which distribution it is: PyPI shows it
as the project's page (pie-engine-cpu, the engine every install has, had none)."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = sorted(path.parent for path in ROOT.glob("pie-*/pyproject.toml"))


def test_every_engine_folder_is_a_distribution() -> None:
    assert {folder.name for folder in DISTRIBUTIONS} >= {"pie-core", "pie-engine-cpu", "pie-engine-vulkan"}


@pytest.mark.parametrize("folder", DISTRIBUTIONS, ids=lambda folder: folder.name)
def test_the_distribution_has_a_readme_that_names_it(folder: Path) -> None:
    project = tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project.get("readme") == "README.md", f"{folder.name}/pyproject.toml names no README"
    heading = (folder / "README.md").read_text(encoding="utf-8").splitlines()[0]
    assert heading == f"# {project['name']}", heading
