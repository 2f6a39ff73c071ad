"""Every shipped example config is valid."""

from pathlib import Path

import pytest

from fedpipe.run.config import load_config
from fedpipe.study.config import load_study

ALL = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
EXAMPLES = [p for p in ALL if not p.name.startswith("study_")]
STUDIES = [p for p in ALL if p.name.startswith("study_")]


def test_there_are_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path):
    cfg = load_config(path)
    assert cfg.method.name in path.name


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_study_example_is_valid(path):
    study, base = load_study(path)  # every run it would make is validated too
    assert len(study.methods) >= 2 and study.budget.trials >= 1


def test_the_federated_example_runs_on_the_sites_own_folders():
    """docs/federation.md's operator runs this config against sites with their own folders: federation mode needs
    data.dataset=files and partition.scheme=natural, and the sites it names are the ones the page's commands start."""
    path = Path(__file__).parent.parent / "examples" / "fedavg_own_images_federation.yaml"
    cfg = load_config(path)
    assert (cfg.engine.mode, cfg.data.dataset, cfg.partition.scheme) == ("federation", "files", "natural")
    assert cfg.federation.site_names == ["hospital-a", "hospital-b"] and cfg.train.rounds == 3
    page = (Path(__file__).parent.parent / "docs" / "federation.md").read_text()
    assert f"-c examples/{path.name}" in page
    # the site folder's rule as the page states it: one client, a subfolder named after the site
    assert "fedpipe site keygen hospital-a" in page and "/data/hospital-a/hospital-a/<label>/" in page
