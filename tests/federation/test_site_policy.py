"""A site runs fedpipe's own code only, and only what its own policy allows (fedpipe/federation/worker.py, policy.py).

One loopback federation (TLS, registered site keys) serves every test here: three sites with their own files (the
digits hospitals of tests/own_data.py), each its warm worker and its SuperNode, each under its own policy file:
- `strict`: local privacy required, its own noise (multiplier at least 1.0, clip at most 1.0), epsilon at most 8,
  images at most 32 pixels;
- `open`: the defaults, seeded noise allowed (the positive control: it answers what `strict` refuses);
- `brief`: the defaults, but at most 0.01 s of training a round (it answers the census, then refuses every round).

Each policy test submits a run that stops after the census (`stop-after census`), so it costs seconds; the
refusal must be named in the run's error (the census's), in the ServerApp's outputs (census.json, rounds.jsonl) and in
the report, and the refusing site must have read none of its data (its folder holds no prepared split).

The hostile-app test submits, through the operator's own connection (`flwr run` with the try-out's connection), an
app whose ClientApp is its own module: in Flower's default isolation every site would install its FAB and run that
module; here no site runs it (no marker file) and its ServerApp hears each site's refusal.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml
from own_data import SITES, write_digit_folders

from fedpipe.data.files.init import init_manifest, write_manifest
from fedpipe.federation.report import write_report
from fedpipe.federation.spec import FederationSpec
from fedpipe.federation.tryout import CONNECTION, LoopbackFederation, submit_app
from fedpipe.run.config import load_config

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(600)]

POLICIES = {
    "strict": {"privacy": {"required": True, "mode": "local", "noise_multiplier": 1.0, "clip": 1.0, "max_epsilon": 8.0},
               "limits": {"max_image_size": 32}},
    "open": {"privacy": {"allow_seeded_noise": True}},
    "brief": {"limits": {"max_train_seconds": 0.01}},
}
BASE = ["method.name=fedavg", "data.dataset=files", "partition.scheme=natural", "data.standardisation=fixed",
        "model.name=twonn", "train.rounds=2", "train.local_epochs=1", "train.batch_size=20", "train.client_fraction=1.0",
        "run.threads=1", "run.seed=0", "telemetry.progress=false", "data.image_size=8"]
# local privacy as `strict` takes it: 2 rounds at noise multiplier 4 spend epsilon 3.2 against the server (delta 1e-5)
PRIVATE = ["privacy.enabled=true", "privacy.mode=local", "privacy.noise_multiplier=4.0", "privacy.clip=1.0", "privacy.delta=1e-5"]


@pytest.fixture(scope="session")
def policed(tmp_path_factory, flower_env):
    work = tmp_path_factory.mktemp("policed")
    pooled = write_digit_folders(work / "pooled")
    manifest, _ = init_manifest(str(pooled))
    write_manifest(str(pooled), manifest)
    folders = {}
    with LoopbackFederation(work / "fed", flower_env, server_root=work) as fed:
        for (name, policy), hospital in zip(POLICIES.items(), SITES):
            files = work / "sites" / name / "files"
            shutil.copytree(pooled / hospital, files / hospital)
            shutil.copy(pooled / "fedpipe-data.yaml", files / "fedpipe-data.yaml")
            (work / "sites" / name / "policy.yaml").write_text(yaml.safe_dump({"name": name, **policy}))
            fed.start_site(work / "sites" / name / "state", name=name, node_config={"data": str(files)},
                           policy=work / "sites" / name / "policy.yaml")
            folders[name] = work / "sites" / name / "state"
        yield {"fed": fed, "work": work, "pooled": pooled, "folders": folders}


def _spec(policed, sets: list[str], sites: int) -> Path:
    """A spec file for a run of the pooled folder's config with `sets`, waiting for `sites` sites."""
    from fedpipe.federation.own_data import site_params

    cfg = load_config(None, [*BASE, f"data.source={policed['pooled']}", *sets])
    spec = FederationSpec.for_sites(cfg, sites, site_params(cfg))
    path = policed["work"] / f"spec-{abs(hash(tuple(sets)))}.json"
    path.write_text(spec.to_json())
    return path


def _census_only(policed, sets: list[str], sites: int = 3, timeout: float = 20) -> tuple[dict | None, str, Path]:
    """Submit a run that stops after its census; (result or None, the error, its out folder)."""
    fed, out = policed["fed"], policed["work"] / f"out-{abs(hash(tuple(sets)))}-{sites}"
    submit_app(fed.bin / "flwr", fed._environ(), fed.work / "fedpipeapp", CONNECTION, _spec(policed, sets, sites), out,
               timeout=timeout, stop_after="census")
    try:
        return fed.wait(out, timeout + 60), "", out
    except RuntimeError as e:
        return None, str(e), out


def _log(folder: Path) -> list[dict]:
    path = folder / "messages.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("sets, reason", [
    ([], "strict refused: privacy is off; it requires it"),
    ([*PRIVATE, "privacy.seeded_noise=true"], "strict refused: seeded noise asked for"),
    ([*PRIVATE, "privacy.noise_multiplier=0.5"], "strict refused: noise multiplier 0.5 below its 1"),
    ([*PRIVATE, "privacy.clip=4.0"], "strict refused: clip 4 above its 1"),
    ([*PRIVATE, "train.rounds=400"], "strict refused: epsilon 96.1 above its 8"),
    ([*PRIVATE, "privacy.mode=central"], "strict refused: privacy mode central; it takes local only"),
    ([*PRIVATE, "data.image_size=1024"], "strict refused: image size 1024 above its 32"),
], ids=["no-privacy", "seeded-noise", "less-noise", "larger-clip", "epsilon", "central-mode", "image-size"])
def test_a_run_outside_a_sites_policy_is_refused_by_name_before_any_data_is_read(policed, sets, reason):
    strict = policed["folders"]["strict"]
    result, error, out = _census_only(policed, sets)
    assert result is None and reason in error, error[:2000]  # the run's error names the site and the rule
    census_refusals = json.loads((out / "census.json").read_text())["refused"] if (out / "census.json").exists() else None
    assert census_refusals is None  # the census failed: only error.json, which names it
    assert reason in (out / "error.json").read_text()
    assert not (strict / "prepared").exists(), sorted(p.name for p in strict.iterdir())  # it read none of its files
    refused = [e for e in _log(strict) if e["decision"] == "refused"]
    assert refused and reason.removeprefix("strict refused: ") in refused[-1]["reason"] and refused[-1]["kind"] == "census"


def test_image_size_beyond_every_sites_bound_names_each_refusal(policed):
    """The default policy bounds images at 512 pixels: a 1024-pixel run is refused by every site, each named."""
    result, error, _ = _census_only(policed, ["data.image_size=1024"])
    assert result is None
    assert "strict refused: " in error and "open refused: image size 1024 above its 512" in error \
        and "brief refused: image size 1024 above its 512" in error, error[:2000]


def test_a_run_within_the_policies_is_taken_and_the_refusals_reach_the_report(policed):
    """The positive control: a run every policy allows at the census (local privacy, the site's own noise) goes
    through; `brief` then refuses every round (its 0.01 s), which the round log and the report name, and the round
    rule counts it as a failed site (the other two carry the round)."""
    fed, out = policed["fed"], policed["work"] / "out-taken"
    spec = _spec(policed, [*PRIVATE, "train.min_clients=2"], 3)
    submit_app(fed.bin / "flwr", fed._environ(), fed.work / "fedpipeapp", CONNECTION, spec, out, timeout=120)
    result = fed.wait(out, 300)
    assert result["stage"] == "evaluate" and result["sites"] == 3
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    for r in rounds:
        assert r["clients"] == 2 and [rej["error"] for rej in r["rejected"]] == \
            [f"SiteError: site {_client_of(out, 'brief')} (node {_node_of(out, 'brief')}): brief refused: the round ran past its 0.01 s"]
    summary = write_report(out, policed["work"] / "report-taken", "policy")
    assert any("brief refused: the round ran past its 0.01 s" in r for r in summary["refused"])
    assert "brief refused: the round ran past its 0.01 s" in (policed["work"] / "report-taken" / "report.html").read_text()
    assert (policed["folders"]["strict"] / "prepared").exists()  # it took this run: its splits were made
    # the census sends no local path or file count: the snapshot's digest only
    census = json.loads((out / "census.json").read_text())
    assert all(set(s["snapshot"]) == {"digest"} for s in census["sites"]), census
    # each site's own log: what it took, what it refused, and the bytes that left it
    brief = _log(policed["folders"]["brief"])
    assert [e["decision"] for e in brief if e["run"] == str(out)][:1] == ["took"]
    assert all(e["decision"] == "refused" for e in brief if e["run"] == str(out) and e["kind"] == "train")
    from fedpipe.federation import site_log

    lines = site_log.summary(policed["folders"]["strict"])
    assert any(str(out) in line and "messages taken" in line and "MB sent" in line for line in lines), lines


def _census_site(out: Path, name: str) -> dict:
    """The census's entry of the site whose policy is `name` (the census names a site by its client's folder)."""
    hospital = dict(zip(POLICIES, SITES))[name]
    return next(s for s in json.loads((out / "census.json").read_text())["sites"] if s["name"] == hospital)


def _client_of(out: Path, name: str) -> int:
    return _census_site(out, name)["client_id"]


def _node_of(out: Path, name: str) -> int:
    return _census_site(out, name)["node_id"]


HOSTILE_CLIENT = '''
import os
from pathlib import Path
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg, context):
    site = Path(str(context.node_config["site-dir"]))
    Path(os.environ.get("HOSTILE_MARKER_DIR", "/tmp"), "ran-" + site.name).write_text(repr(sorted(os.listdir(site))))
    return Message(RecordDict({"site": ConfigRecord({"listing": repr(sorted(os.listdir(site)))})}), reply_to=msg)
'''

HOSTILE_SERVER = '''
import json
import time
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import ServerApp

app = ServerApp()


@app.main()
def main(grid, context):
    nodes = list(grid.get_node_ids())
    replies = grid.send_and_receive([Message(RecordDict({"ask": ConfigRecord({"what": "listing"})}), dst_node_id=n,
                                             message_type=MessageType.QUERY) for n in nodes], timeout=60)
    got = [{"error": r.error.reason} if r.has_error() else {"content": str(r.content)} for r in replies]
    with open(context.run_config["out"], "w") as f:
        json.dump({"nodes": len(nodes), "replies": got}, f)
'''


def test_a_submitted_app_with_its_own_clientapp_runs_at_no_site(policed, tmp_path):
    """Through the operator's own connection, as `flwr run` takes any app: its ClientApp is its own module, which
    would write a marker file and list the site's folder. No site runs it; each site's refusal names why."""
    fed = policed["fed"]
    app = tmp_path / "hostile"
    app.mkdir()
    (app / "hostile_client.py").write_text(HOSTILE_CLIENT)
    (app / "hostile_server.py").write_text(HOSTILE_SERVER)
    out = tmp_path / "hostile-out.json"
    (app / "pyproject.toml").write_text(f'''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hostile"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "hostile_server:app"
clientapp = "hostile_client:app"

[tool.flwr.app.config]
out = "{out}"
''')
    markers = tmp_path / "markers"
    markers.mkdir()
    environ = fed._environ({"HOSTILE_MARKER_DIR": str(markers)})
    import subprocess

    from fedpipe.federation.control import cli_command  # the operator's connection sends the Control API's token

    done = subprocess.run([*cli_command(fed.bin / "flwr", environ), "run", str(app), CONNECTION, "--format", "json"],
                          capture_output=True, text=True, env=environ, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 120
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert out.exists(), fed.log_of("superlink")[-3000:]
    heard = json.loads(out.read_text())
    assert heard["nodes"] == 3 and len(heard["replies"]) == 3, heard
    for name in POLICIES:
        assert any(f"{name} refused: the app bundle holds hostile_client.py" in r.get("error", "") for r in heard["replies"]), heard
    assert not list(markers.iterdir())  # no site ran the app's code
    for folder in policed["folders"].values():
        refused = [e for e in _log(folder) if "hostile_client.py" in e.get("reason", "")]
        assert refused and refused[-1]["decision"] == "refused", _log(folder)[-3:]


def test_a_killed_worker_takes_its_supernode_with_it_and_the_site_rejoins(policed):
    """SIGKILL to the worker alone (not its process group): its SuperNode dies with it (PR_SET_PDEATHSIG), so a
    supervisor that restarts the site gets a working pair again, with the same key and folder."""
    fed = policed["fed"]
    worker = fed.procs["open"]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    deadline = time.monotonic() + 20
    from fedpipe.federation.tryout import descendants

    while time.monotonic() < deadline and any("fedpipe.federation.supernode" in c for _, c in descendants(1) if f"{policed['folders']['open']}" in c):
        time.sleep(0.3)
    assert not [c for _, c in descendants(1) if "fedpipe.federation.supernode" in c and str(policed["folders"]["open"]) in c]
    fed.procs.pop("open")
    seconds = fed.restart_site("open", timeout=150)
    assert seconds < 150
    result, error, _ = _census_only(policed, [*PRIVATE], sites=3)
    assert result is not None and result["stage"] == "census", error[:2000]
