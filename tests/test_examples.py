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
