"""The ServerApp's checkpoint (fedpipe.federation.resume), without Flower: what it saves, and what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from fedpipe.algorithms.base import ServerState
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError
from fedpipe.federation import resume

SPEC = json.dumps({"method": {"name": "fedavg"}, "seed": 0})


def _state(round_: int = 2, clients=None) -> PhaseState:
    return PhaseState("fedavg", "federation", round_, ServerState({"w": torch.arange(6.0).reshape(2, 3)}), clients or {})


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert resume.load(tmp_path, SPEC, "fedavg") is None
    assert not (tmp_path / resume.RESUMES).exists()


def test_the_checkpoint_round_trips_and_the_resume_is_recorded(tmp_path):
    resume.save(tmp_path, _state(), SPEC)
    back = resume.load(tmp_path, SPEC, "fedavg")
    assert (back.phase, back.round) == ("federation", 2) and not back.clients
    assert torch.equal(back.server.global_params["w"], torch.arange(6.0).reshape(2, 3))
    assert [json.loads(x) for x in (tmp_path / resume.RESUMES).read_text().splitlines()] == [{"from_phase": "federation", "from_round": 2}]
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: no temporary left


def test_another_specs_checkpoint_is_refused(tmp_path):
    resume.save(tmp_path, _state(), SPEC)
    with pytest.raises(ConfigError, match="checkpoint of another run"):
        resume.load(tmp_path, SPEC.replace('"seed": 0', '"seed": 1'), "fedavg")


def test_the_server_never_checkpoints_a_client_state(tmp_path):
    with pytest.raises(ValueError, match="holds client states"):
        resume.save(tmp_path, _state(clients={3: {"w": torch.zeros(1)}}), SPEC)
    assert not (tmp_path / resume.CHECKPOINT).exists()
