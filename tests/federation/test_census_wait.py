"""The census waits for the sites the config names (federation.site_names): with all of them connected it takes them
and leaves out a site that is not named; when one does not come, the timeout's error names it and the sites that did
answer. Flower's Grid is stood in for (tests/federation/census_wait_inprocess.py, run in the Flower environment): the
rule under test is fedpipe's `server_app.wait_for_sites`, not Flower's transport, which the loopback tests run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.federation, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
NAMED = ["hospital-a", "hospital-b", "hospital-c"]


CASES = {
    "named": (["hospital-c", "intruder", "hospital-a", "hospital-b"], 3, NAMED, 2.0),
    "one missing": (["hospital-a", "hospital-b"], 3, NAMED, 2.0),
    "no names": (["hospital-b", "hospital-a"], 2, [], 2.0),
    "malformed": (["hospital-a", "classes-x", "hospital-b", "json-y"], 2, [], 2.0),
}


@pytest.fixture(scope="module")
def waited(flower_env) -> dict:
    r = subprocess.run([str(flower_env / "bin" / "python"), str(Path(__file__).with_name("census_wait_inprocess.py")),
                        json.dumps(list(CASES.values()))], capture_output=True, text=True, timeout=200,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(zip(CASES, json.loads(r.stdout.strip().splitlines()[-1])))


def test_the_named_sites_are_taken_and_an_unnamed_one_is_left_out(waited):
    assert waited["named"]["names"] == NAMED


def test_a_named_site_that_does_not_come_is_named_by_the_timeout(waited):
    out = waited["one missing"]
    assert out["error"] == "TimeoutError", out
    assert "only 2 of 3 sites answered within 2s" in out["message"]
    assert "answered: hospital-a, hospital-b; missing: hospital-c" in out["message"]
    assert "fedpipe site join" in out["message"]


def test_without_names_any_sites_do(waited):
    assert waited["no names"]["names"] == ["hospital-a", "hospital-b"]


def test_a_malformed_census_answer_is_that_sites_refusal_and_the_others_go_on(waited):
    """An audit's dishonest sites: one claims 10^6 classes (the server would have built a 201-million-parameter model),
    one sends JSON cut short (a raw decode error ended the run). Each is refused by name; the census fixes the others'
    sample counts, which the server weighs them by."""
    out = waited["malformed"]
    assert out["names"] == ["hospital-a", "hospital-b"] and out["samples"] == [10, 10], out
    refused = " | ".join(out["refused"])
    assert "site 'classes-x' (node 101) sent a census answer fedpipe cannot take (census: num_classes" in refused, refused
    assert "the site on node 103 sent a census answer fedpipe cannot take (census: " in refused, refused
