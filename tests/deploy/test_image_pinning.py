"""The chart's fedpipe containers never run a stale copy of a moved tag (issue 30, item 6): named by tag they are
pulled `Always` (the kubelet re-checks the tag's digest; the layers stay cached), pinned by digest `IfNotPresent`;
a policy set by hand wins. The plain manifests' registration Job does the same."""

from __future__ import annotations

import yaml
from deploytools import MANIFESTS

DIGEST = "sha256:" + "ab" * 32


def fedpipe_containers(docs: list[dict]) -> list[dict]:
    pods = [d["spec"]["template"]["spec"] if "template" in d.get("spec", {}) else d["spec"] for d in docs
            if d["kind"] in ("Job", "Pod")]
    return [c for pod in pods for c in pod.get("initContainers", []) + pod["containers"] if "/fedpipe" in c["image"]]


def test_a_tag_is_pulled_always_and_a_digest_once(render_chart):
    by_tag = fedpipe_containers(render_chart("--set", "schedule.cron=0 0 3 * * *"))
    assert by_tag and {c["imagePullPolicy"] for c in by_tag} == {"Always"}
    pinned = fedpipe_containers(render_chart("--set", f"image.digest={DIGEST}"))
    assert pinned and {(c["image"].endswith("@" + DIGEST), c["imagePullPolicy"]) for c in pinned} == {(True, "IfNotPresent")}
    chosen = fedpipe_containers(render_chart("--set", "image.pullPolicy=IfNotPresent"))
    assert {c["imagePullPolicy"] for c in chosen} == {"IfNotPresent"}


def test_the_manifests_registration_job_pulls_its_tag_always():
    job = yaml.safe_load((MANIFESTS / "register-job.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["imagePullPolicy"] == "Always"
