"""Malformed uploads over a real loopback federation: each refused by name while the round goes on.

FedAvg, 4 sites, 2 rounds, every site every round. Three sites corrupt their upload with the ClientApp's test-only
fault injector (`FEDPIPE_TEST_FAULT_INJECTOR`, fedpipe/federation/client_app.py; off unless a test sets it in a
site's environment): site-1 sends a tensor with the wrong shape, site-2 one holding a NaN, site-3 one ten times too
big. The server's check (`transport.check_upload`) must refuse each with an error naming the site and the reason,
and each round must still aggregate site-0's upload (train.min_clients=1).
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from fedpipe.federation.faults import FAULT_INJECTOR_ENV
from fedpipe.federation.tryout import LoopbackFederation, prepare
from fedpipe.run.config import load_config

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(600)]

OVERRIDES = ["method.name=fedavg", "partition.scheme=pathological", "partition.num_clients=4", "model.name=twonn",
             "train.rounds=2", "train.local_epochs=1", "train.batch_size=50", "train.client_fraction=1.0",
             "train.min_clients=1", "engine.clients=sequential", "run.threads=1", "run.seed=0", "telemetry.progress=false"]
FAULTS = {1: "wrong-shape", 2: "nan", 3: "oversized"}
REASONS = {1: "has shape", 2: "non-finite", 3: "bytes, more than"}


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def faulty(tmp_path_factory, flower_env):
    work = tmp_path_factory.mktemp("upload-faults")
    cfg = load_config(None, [*OVERRIDES, f"run.store={work / 'store'}", "run.id=faults"])
    spec_file, folders = prepare(cfg, work)
    with LoopbackFederation(work, flower_env) as fed:
        for folder in folders:
            cid = int(folder.name.split("-")[1])
            fed.start_site(folder, env={FAULT_INJECTOR_ENV: FAULTS[cid]} if cid in FAULTS else None)
        result = fed.run(spec_file, work / "out", timeout=300)
    rounds = [json.loads(line) for line in (work / "out" / "rounds.jsonl").read_text().splitlines()]
    return dict(work=work, result=result, rounds=rounds)


def test_each_malformed_upload_is_refused_by_name(faulty):
    for r in faulty["rounds"]:
        errors = {e["client"]: e["error"] for e in r["rejected"]}
        assert sorted(errors) == [1, 2, 3], r
        for cid, reason in REASONS.items():
            assert errors[cid].startswith("UploadRejected: ") and f"site {cid} " in errors[cid] and reason in errors[cid], errors[cid]


def test_the_round_goes_on_with_the_others(faulty):
    assert faulty["result"]["round"] == 2
    assert [(r["clients"], r["failed"]) for r in faulty["rounds"]] == [(1, 3), (1, 3)]
    assert all(r["bytes_up"] > 0 for r in faulty["rounds"])  # site-0's upload, aggregated
    final = safetensors.torch.load_file(str(faulty["work"] / "out" / "global.safetensors"))
    assert all(torch.isfinite(t).all() for t in final.values())
