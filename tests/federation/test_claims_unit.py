"""What decides the aggregate is the census's, not a reply's: a site's census answer is bounded and typed before it
is used (`census.read_answer`), its sample counts are fixed for the run, and a train or evaluation reply whose count
disagrees, or whose score is not a finite fraction, is refused by name (`census.vouched_samples`, `vouched_scores`);
the federated gate weighs each site by the census's held-out count (`models.federated.site_scores`). The attacks are
an audit's: a site claiming 10^6 (or NaN, or -700) samples, 10^6 classes, a malformed or deeply nested answer, and a
site claiming 10^9 held-out samples at a perfect score. The loopback federation runs the same rules end to end
(tests/federation/test_upload_faults.py)."""

from __future__ import annotations

import json

import pytest

from fedpipe.federation.census import CensusError, ClaimRefused, Samples, read_answer, vouched_samples, vouched_scores
from fedpipe.models.federated import decide_federated, site_scores
from fedpipe.models.line import ModelLine
from fedpipe.run.config import load_config
from fedpipe.store import open_store

OWN = {"name": "hospital-a", "labels": ["0", "1"], "input_shape": [1, 8, 8], "num_classes": 2,
       "counts": {"train": [3, 4], "val": [1, 1], "test": [2, 2], "holdout": [5, 5]}, "snapshot": {"digest": "ab12"}}
SAMPLES = {"train": 7, "test": 4, "holdout": 10}


def _reply(census=OWN, samples=SAMPLES, **extra):
    return {"client-id": -1, "opt-out": False, "census": census if isinstance(census, str) else json.dumps(census),
            "samples": samples if isinstance(samples, str) else json.dumps(samples), **extra}


def test_a_well_formed_answer_is_read_with_its_counts():
    a = read_answer(7, _reply())
    assert a["census"]["name"] == "hospital-a" and a["samples"] == Samples(train=7, test=4, holdout=10)
    exported = read_answer(8, {"client-id": 3, "opt-out": True, "samples": json.dumps(SAMPLES)})
    assert exported["census"] is None and exported["client-id"] == 3 and exported["opt-out"] is True


@pytest.mark.parametrize("reply, names", [
    (_reply({**OWN, "num_classes": 10**6}), ("site 'hospital-a' (node 7)", "census: num_classes")),
    (_reply({**OWN, "num_classes": 5}), ("site 'hospital-a' (node 7)", "num_classes 5 but 2 labels")),
    (_reply('{"name": "hospital-a", "labels": ['), ("the site on node 7", "census")),
    (_reply("[" * 100_000 + "]" * 100_000), ("the site on node 7", "census")),
    (_reply({**OWN, "input_shape": [1, 10**6, 10**6]}), ("site 'hospital-a'", "input_shape")),
    (_reply({**OWN, "counts": {**OWN["counts"], "train": [1, 2, 3]}}), ("site 'hospital-a'", "3 label counts")),
    (_reply(samples={"train": -700, "test": 4}), ("site 'hospital-a'", "train")),
    (_reply(samples='{"train": NaN, "test": 4}'), ("site 'hospital-a'", "samples")),
    ({"client-id": "0", "opt-out": False}, ("the site on node 7", "client-id")),
    ({"opt-out": False}, ("the site on node 7", "client-id")),
])
def test_a_malformed_census_answer_is_refused_by_name(reply, names):
    with pytest.raises(CensusError) as e:
        read_answer(7, reply)
    for part in names:
        assert part in str(e.value), str(e.value)
    assert "left out of the run" in str(e.value)


COUNTED = Samples(train=228, test=50, holdout=100)


@pytest.mark.parametrize("claim", [10**6, 10**12, float("nan"), float("inf"), -700, 227, 228.5, "228", True, None])
def test_a_train_reply_whose_count_is_not_the_census_count_is_refused(claim):
    metrics = {} if claim is None else {"num-samples": claim}
    with pytest.raises(ClaimRefused, match=r"site 1 \(node 9\) states .* the census counted 228"):
        vouched_samples("site 1 (node 9)", COUNTED, metrics, private=False)


def test_the_weight_is_the_census_count():
    assert vouched_samples("s", COUNTED, {"num-samples": 228}, private=False) == 228
    assert vouched_samples("s", COUNTED, {"num-samples": 228.0}, private=False) == 228
    assert vouched_samples("s", COUNTED, {"private": 1}, private=True) == 0  # privacy: no sample weights
    with pytest.raises(ClaimRefused, match="no sample counts"):
        vouched_samples("s", None, {"num-samples": 228}, private=False)


@pytest.mark.parametrize("metrics, why", [
    ({"holdout-accuracy": 1.0, "holdout-samples": 1e9}, "census counted 100"),
    ({"test-samples": 51}, "census counted 50"),
    ({"holdout-accuracy": 1.5}, "a fraction"),
    ({"accuracy": float("nan")}, "not a finite number"),
    ({"champion-holdout-accuracy": -0.1}, "a fraction"),
    ({"secret": 1.0}, "does not make"),
])
def test_an_evaluation_reply_that_does_not_add_up_is_refused(metrics, why):
    with pytest.raises(ClaimRefused, match=why):
        vouched_scores("site 2 (node 9)", COUNTED, metrics)


CENSUS = {"sites": [{"client_id": k, "name": f"h{k}", "samples": {"train": 100, "test": 40, "holdout": 100}} for k in range(4)]}
HONEST = {str(k): {"accuracy": 0.8, "holdout-accuracy": 0.76, "holdout-samples": 100.0, "test-samples": 40.0,
                   "champion-holdout-accuracy": 0.80} for k in range(3)}
LIAR = {"accuracy": 1.0, "holdout-accuracy": 1.0, "holdout-samples": 1e9, "test-samples": 40.0, "champion-holdout-accuracy": 0.8}


def _cfg(*sets):
    return load_config(None, ["registry.name=line", "registry.gate_metric=global_accuracy", *sets])


def _server_side(evaluation):
    """What evaluation.json holds: the replies `vouched_scores` takes (the server's evaluate_at_sites)."""
    kept = {}
    for cid, metrics in evaluation.items():
        try:
            kept[cid] = vouched_scores(f"site {cid}", Samples(**CENSUS["sites"][int(cid)]["samples"]), metrics)
        except ClaimRefused:
            pass
    return kept


def test_the_gate_with_a_site_claiming_a_huge_count_and_a_perfect_score_decides_as_without_it(tmp_path):
    """Three honest sites fall from 0.80 to 0.76 (refused); a fourth claiming 10^9 held-out samples at 1.0 would turn
    that into a promotion if its count weighed it (the audit: a plausible 400 was enough)."""
    line = ModelLine(open_store(str(tmp_path / "store")), "line")
    without = decide_federated(_cfg(), _server_side(HONEST), CENSUS, line, 3)
    assert not without.promote
    with_liar = decide_federated(_cfg(), _server_side({**HONEST, "3": LIAR}), CENSUS, line, 3)
    assert (with_liar.promote, with_liar.candidate, with_liar.champion) == (without.promote, without.candidate, without.champion)
    assert with_liar.compared["names"] == ["h0", "h1", "h2"] and with_liar.compared["samples"] == 300
    # even a figure that reached the gate unvouched is weighed by the census's count, not its own
    plausible = {**HONEST, "3": {**LIAR, "holdout-samples": 400.0}}
    assert site_scores(plausible, CENSUS, "holdout-accuracy")[1] == pytest.approx((3 * 0.76 + 1.0) / 4)
    hostile = {**HONEST, "3": {**LIAR, "holdout-accuracy": float("nan")}}
    assert "h3" not in site_scores(hostile, CENSUS, "holdout-accuracy")[0]
