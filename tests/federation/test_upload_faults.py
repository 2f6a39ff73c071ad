"""Malformed uploads and dishonest claims over a real loopback federation: each refused by name while the round goes on.

FedAvg, 4 sites, 2 rounds, every site every round. Three sites corrupt their replies with the ClientApp's test-only
fault injector (`FEDPIPE_TEST_FAULT_INJECTOR`, fedpipe/federation/faults.py; off unless a test sets it in a
site's environment). In round 1 site-1 sends a tensor with the wrong shape, site-2 one holding a NaN, site-3 one ten
times too big: the server's check (`transport.check_upload`) must refuse each with an error naming the site and the
reason. In round 2 their uploads are honest but their sample counts are an audit's attacks: site-1 claims 10^6
(it has about 200; the weighted mean would be its own upload), site-2 NaN (it ended the run), site-3 -700 (it
flips the mean's sign): each is refused by name against the census's count (`census.vouched_samples`), so the
global model is exactly the honest site-0's upload. At the evaluation site-1 claims a perfect score on 10^9 test
samples: refused (`census.vouched_scores`), it is left out of the evaluation. Each round still aggregates site-0's
upload (train.min_clients=1).
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from fedpipe.federation import audit
from fedpipe.federation.audit import AUDIT_ENV
from fedpipe.federation.faults import FAULT_INJECTOR_ENV
from fedpipe.federation.tryout import LoopbackFederation, prepare
from fedpipe.run.config import load_config

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(600)]

OVERRIDES = ["method.name=fedavg", "partition.scheme=pathological", "partition.num_clients=4", "model.name=twonn",
             "train.rounds=2", "train.local_epochs=1", "train.batch_size=50", "train.client_fraction=1.0",
             "train.min_clients=1", "engine.clients=sequential", "run.threads=1", "run.seed=0", "telemetry.progress=false"]
FAULTS = {1: "wrong-shape@1,samples-huge@2,evaluation-inflated", 2: "nan@1,samples-nan@2", 3: "oversized@1,samples-negative@2"}
REASONS = {1: {1: "has shape", 2: "states 1000000 training samples, but the census counted"},
           2: {1: "non-finite", 2: "states nan training samples, but the census counted"},
           3: {1: "bytes, more than", 2: "states -700 training samples, but the census counted"}}


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def faulty(tmp_path_factory, flower_env):
    work = tmp_path_factory.mktemp("upload-faults")
    cfg = load_config(None, [*OVERRIDES, f"run.store={work / 'store'}", "run.id=faults"])
    spec_file, folders = prepare(cfg, work)
    with LoopbackFederation(work, flower_env) as fed:
        for folder in folders:
            cid = int(folder.name.split("-")[1])
            fed.start_site(folder, env={FAULT_INJECTOR_ENV: FAULTS[cid]} if cid in FAULTS else {AUDIT_ENV: "1"})
        result = fed.run(spec_file, work / "out", timeout=300)
    rounds = [json.loads(line) for line in (work / "out" / "rounds.jsonl").read_text().splitlines()]
    return dict(work=work, result=result, rounds=rounds, honest=next(f for f in folders if f.name.endswith("-0")))


def test_each_malformed_upload_and_false_count_is_refused_by_name(faulty):
    for r in faulty["rounds"]:
        errors = {e["client"]: e["error"] for e in r["rejected"]}
        assert sorted(errors) == [1, 2, 3], r
        for cid, reasons in REASONS.items():
            reason = reasons[r["round"]]
            assert errors[cid].startswith("UploadRejected: ") and f"site {cid} " in errors[cid] and reason in errors[cid], errors[cid]


def test_the_global_model_is_the_honest_sites_alone(faulty):
    """One upload weighed by its census count: the float64 mean of one term is that term, so the global model after
    round 2 is site-0's round-2 upload bit for bit (its digest, kept by the test-only audit at site-0)."""
    final = safetensors.torch.load_file(str(faulty["work"] / "out" / "global.safetensors"))
    lines = [json.loads(x) for x in (faulty["honest"] / audit.FILE).read_text().splitlines()]
    (upload,) = [x["digest"] for x in lines if x["where"] == "plain-upload" and x["round"] == 2]
    assert audit.digest(final.values()) == upload


def test_an_inflated_evaluation_is_left_out(faulty):
    evaluation = json.loads((faulty["work"] / "out" / "evaluation.json").read_text())
    assert sorted(evaluation) == ["0", "2", "3"] and all(e["test-samples"] < 1e9 for e in evaluation.values())


def test_the_round_goes_on_with_the_others(faulty):
    assert faulty["result"]["round"] == 2
    assert [(r["clients"], r["failed"]) for r in faulty["rounds"]] == [(1, 3), (1, 3)]
    assert all(r["bytes_up"] > 0 for r in faulty["rounds"])  # site-0's upload, aggregated
    final = safetensors.torch.load_file(str(faulty["work"] / "out" / "global.safetensors"))
    assert all(torch.isfinite(t).all() for t in final.values())
