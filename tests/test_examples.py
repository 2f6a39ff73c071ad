"""Every shipped example config is valid."""

from pathlib import Path

import pytest

from fedpipe.run.config import load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path):
    cfg = load_config(path)
    assert cfg.method.name in path.name
