"""Sites with their own files, as a user runs them: `fedpipe site keygen` and `fedpipe site join` at each site (each
site process reads only its own folder of images and its own fedpipe-data.yaml, makes its splits itself, answers the
census, and trains), and `fedpipe run` with engine.mode=federation submitting the run to the SuperLink; the result
equals the simulation of all sites' files.

Five hospitals (scikit-learn's 8x8 digits as PNG files, each hospital four of the ten digits: tests/own_data.py).
The simulation reads the pooled folder (data.dataset=files, partition.scheme=natural); each site gets a copy of its
hospital's folder and the manifest only. The SuperLink (TLS, SuperNode authentication) is the try-out's
(`LoopbackFederation`); the site keys are registered with `flwr supernode register`.

Why the two agree: a sample's hold-out and split are drawn from its identity (client and file name) and the seed
alone (`fedpipe.data.partition.make`), so each site's own split is the simulation's split of its client (checked
tensor for tensor in test_census_unit.py); the standardisation is fixed (no site's pixels shape it); the sites are
numbered by their sorted names as the pooled folder's clients are. Tolerance: that of test_loopback.py (rtol 1e-5,
atol 1e-6), for the same reasons.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch
from own_data import SITES, write_digit_folders
from runs import train_all

from fedpipe.data.files.init import init_manifest, write_manifest
from fedpipe.data.partition import make_partition
from fedpipe.federation.certs import make_tls
from fedpipe.federation.control import TOKEN_ENV
from fedpipe.federation.tryout import LoopbackFederation, free_port
from fedpipe.pipelines.local_runner import run_method_locally
from fedpipe.plots import census_heatmap
from fedpipe.run.config import load_config
from fedpipe.run.run import Run
from fedpipe.store import open_store

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(600)]

OVERRIDES = ["method.name=fedavg", "data.dataset=files", "partition.scheme=natural", "data.standardisation=fixed",
             "model.name=twonn", "train.rounds=3", "train.local_epochs=1", "train.batch_size=20", "train.lr=0.05",
             "train.client_fraction=1.0", "engine.clients=sequential", "run.threads=1", "run.seed=0", "telemetry.progress=false"]


def _fedpipe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpipe.cli", *args], capture_output=True, text=True, timeout=timeout)


PIPELINE_BUCKET = "kubeflow-runs"
PRIVATE = ["privacy.enabled=true", "privacy.noise_multiplier=0.3", "privacy.clip=1.0", "privacy.census_noise_multiplier=3"]


def _benchmarked(root, method: str) -> dict:
    """One method's run of the benchmark pipeline (its summary in the comparison task's results): its census, rounds,
    summary and heatmap from the run's store."""
    from pathlib import Path

    (results,) = [p for p in root.rglob("results") if p.parent.name.startswith("compare")]
    summary = next(s for s in json.loads(results.read_text()) if s["method"] == method)
    out, report = Path(summary["folder"]), Path(summary["report"]).parent
    return dict(summary=summary, census=json.loads((out / "census.json").read_text()), heatmap=report / "census.png",
                rounds=[json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()])


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def own_files(tmp_path_factory, flower_env, s3_server, s3_credentials):
    work = tmp_path_factory.mktemp("own-files")
    # the pipeline's run store is S3 (moto's server, an emulator of MinIO's API): the SuperLink's ServerApp and the
    # pipeline's tasks meet there, as on a cluster, where both get the store's endpoint and credentials in their env
    saved = {k: os.environ.get(k) for k in ("FEDPIPE_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "FEDPIPE_FLOWER_ENV",
                                                 TOKEN_ENV)}
    os.environ.update({"FEDPIPE_S3_ENDPOINT": s3_server, "AWS_ACCESS_KEY_ID": s3_credentials[0],
                       "AWS_SECRET_ACCESS_KEY": s3_credentials[1], "FEDPIPE_FLOWER_ENV": str(flower_env)})
    try:
        yield _own_files(work, flower_env, s3_server, s3_credentials)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _own_files(work, flower_env, s3_server, s3_credentials) -> dict:
    from minio import Minio

    Minio(s3_server.removeprefix("http://"), access_key=s3_credentials[0], secret_key=s3_credentials[1], secure=False,
          region="us-east-1").make_bucket(PIPELINE_BUCKET)
    pooled = write_digit_folders(work / "pooled")
    manifest, _ = init_manifest(str(pooled))
    write_manifest(str(pooled), manifest)
    sets = [*OVERRIDES, f"data.source={pooled}"]
    sim_cfg = load_config(None, [*sets, f"run.store={work / 'store'}", "run.id=own-files"])
    sim_run = Run(sim_cfg)
    state = train_all(sim_run)
    partition = make_partition(sim_run.bundle, sim_cfg.partition, sim_cfg.run.seed)
    store = work / "fed-store"
    # the SuperLink serves the runs of two stores (`fedpipe run`'s folder, the pipeline's S3), and the submitters (this
    # process's `fedpipe run` and the pipeline's tasks) hold the Control API's token, as a cluster's task pods do
    with LoopbackFederation(work / "fed", flower_env, server_root=work,
                            server_store=f"{store},s3://{PIPELINE_BUCKET}/fedpipe") as fed:
        os.environ[TOKEN_ENV] = str(fed.token)
        for name in SITES:  # each hospital: its own folder, its own key, its own process
            files = work / "sites" / name / "files"
            shutil.copytree(pooled / name, files / name)
            shutil.copy(pooled / "fedpipe-data.yaml", files / "fedpipe-data.yaml")
            made = _fedpipe("site", "keygen", name, "--out", str(work / "sites" / name / "key"))
            assert made.returncode == 0, made.stdout + made.stderr
            fed.register(work / "sites" / name / "key" / f"{name}.pub")
            fed._spawn(name, [sys.executable, "-m", "fedpipe.cli", "site", "join", "--data", str(files),
                              "--superlink", f"127.0.0.1:{fed.port}", "--root-certificates", str(fed.tls["ca_cert"]),
                              "--key", str(work / "sites" / name / "key" / f"{name}.key"),
                              "--state", str(work / "sites" / name / "state"), "--port", str(free_port())])
        # `fedpipe site check` (the fedpipe-site chart's helm test) against the live SuperLink: with the federation's CA,
        # and with a CA that did not sign the SuperLink's certificate
        site_a = work / "sites" / SITES[0]
        check_args = ["site", "check", "--data", str(site_a / "files"), "--superlink", f"127.0.0.1:{fed.port}",
                      "--key", str(site_a / "key" / f"{SITES[0]}.key")]
        checked = _fedpipe(*check_args, "--root-certificates", str(fed.tls["ca_cert"]))
        other_ca = make_tls(work / "other-ca")["ca_cert"]
        wrong_ca = _fedpipe(*check_args, "--root-certificates", str(other_ca))
        federated = [*sets, "engine.mode=federation", f"federation.superlink=127.0.0.1:{fed.port}", f"run.store={store}",
                     f"federation.root_certificates={fed.tls['ca_cert']}", f"federation.sites={len(SITES)}",
                     "registry.name=hospitals", "registry.gate_metric=global_accuracy"]
        done = _fedpipe("run", *(f"--set={s}" for s in [*federated, "run.id=federated"]), timeout=500)
        assert done.returncode == 0, done.stdout + done.stderr + fed.log_of("superlink")[-3000:]
        # the line's next version: a shorter run warm-started from the promoted version 1 (train.init_from, pinned by
        # `fedpipe run`) and gated against it, which the sites score on the same samples
        again = _fedpipe("run", *(f"--set={s}" for s in [*federated, "run.id=federated-2", "train.rounds=1", "train.init_from=promoted"]),
                         timeout=300)
        # a comparison across the federation: the benchmark pipeline's federation branch (one census, each method its own
        # run through the same SuperLink on the same sites), from `fedpipe run --benchmark`; private, so the census
        # releases the label counts through the Gaussian mechanism (each site's own noise)
        bench = _fedpipe("run", "--benchmark", "fedavg", "--benchmark", "local", "--pipeline-root", str(work / "bench-kfp"),
                         *(f"--set={s}" for s in [*federated, "train.rounds=1", "registry.name=", *PRIVATE]), timeout=400)
        # the method's compiled pipeline in federation mode (the run parameter engine_mode; kfp's local runner, each
        # task its own process): the census, the phase and the evaluation, each a submission of its own
        from_ui = load_config(None, [*sets, "engine.mode=federation", f"federation.superlink=127.0.0.1:{fed.port}",
                                     f"federation.root_certificates={fed.tls['ca_cert']}", f"federation.site_names=[{','.join(SITES)}]",
                                     f"run.store=s3://{PIPELINE_BUCKET}/fedpipe", "run.id=from-the-ui", "train.rounds=2",
                                     "registry.name=hospitals-ui", "registry.gate_metric=global_accuracy"])
        artifacts = run_method_locally(from_ui, work / "kfp")
        evaluation_ui = json.loads(open_store(str(from_ui.run.store)).get("from-the-ui/federation/evaluation.json"))
        logs = {name: fed.log_of(name) for name in SITES}
    assert again.returncode == 0, again.stdout + again.stderr
    assert bench.returncode == 0, bench.stdout + bench.stderr[-4000:]
    # the simulation of that second run: the same config, warm-started from the same version of the same line
    from fedpipe.models.warm import attach

    warm_cfg = load_config(None, [*sets, f"run.store={store}", "run.id=warm-simulated", "registry.name=hospitals", "train.rounds=1",
                                  "train.init_from=1"])
    warm_state = train_all(attach(Run(warm_cfg)))
    out = store / "federated" / "federation"
    report = store / "federated" / "report"
    return dict(work=work, stdout=done.stdout, from_ui=from_ui, artifacts=artifacts, evaluation_ui=evaluation_ui, logs=logs, out=out, report=report, store=store, again=again.stdout, again_err=again.stderr,
                checked=checked, wrong_ca=wrong_ca,
                evaluation_2=json.loads((store / "federated-2" / "federation" / "evaluation.json").read_text()),
                simulated={k: v.detach().cpu() for k, v in state.server.global_params.items()},
                warm_simulated={k: v.detach().cpu() for k, v in warm_state.server.global_params.items()},
                warm_federated=safetensors.torch.load_file(str(store / "federated-2" / "federation" / "global.safetensors")),
                federated=safetensors.torch.load_file(str(out / "global.safetensors")), partition=partition, bundle=sim_run.bundle,
                result=json.loads((out / "result.json").read_text()), census=json.loads((out / "census.json").read_text()),
                evaluation=json.loads((out / "evaluation.json").read_text()), summary=json.loads((report / "summary.json").read_text()),
                rounds=[json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()],
                bench=bench.stdout, bench_err=bench.stderr,
                private=_benchmarked(work / "bench-kfp", "fedavg"))


def test_sites_with_their_own_files_train_the_simulations_model(own_files):
    assert own_files["result"]["sites"] == len(SITES) and own_files["result"]["round"] == 3
    assert [r["clients"] for r in own_files["rounds"]] == [len(SITES)] * 3
    sim, fed = own_files["simulated"], own_files["federated"]
    assert sim.keys() == fed.keys()
    for name in sim:
        torch.testing.assert_close(fed[name], sim[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_warm_started_federated_run_equals_its_simulation(own_files):
    """train.init_from=promoted in a federation: the server's round 0 is version 1's global model (not the seed's), so
    its one round equals a simulated round warm-started from the same version (fedpipe.models.warm.warm_start: a
    federated version holds no client's state, so the simulated clients start without one, as the sites do)."""
    sim, fed = own_files["warm_simulated"], own_files["warm_federated"]
    assert sim.keys() == fed.keys()
    for name in sim:
        torch.testing.assert_close(fed[name], sim[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert "starting from version 1 of model line 'hospitals'" in own_files["again_err"]


def test_site_check_reaches_the_superlink_and_reads_only_the_sites_data(own_files):
    """`fedpipe site check` (the fedpipe-site chart's helm test): the site's files, its key and a TLS handshake with the
    live SuperLink, checked against the federation's CA; against a CA that did not sign the SuperLink's certificate it
    fails, saying so."""
    ok, bad = own_files["checked"], own_files["wrong_ca"]
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"site {SITES[0]}:" in ok.stdout and "TLS handshake done" in ok.stdout
    assert bad.returncode != 0 and "does not check against" in bad.stderr and "other-ca" in bad.stderr, bad.stderr


def test_census_is_the_simulations_partition(own_files, tmp_path):
    """The census the sites reported: their names in the pooled folder's client order, and per site the label counts
    of its splits, equal to the simulation's partition of the pooled files; the heatmap is drawn from it."""
    census, partition, bundle = own_files["census"], own_files["partition"], own_files["bundle"]
    assert [s["name"] for s in census["sites"]] == list(bundle.client_names) == sorted(SITES)
    assert [s["client_id"] for s in census["sites"]] == list(range(len(SITES)))
    labels = bundle.train.y
    for site, client in zip(census["sites"], partition.clients):
        for split in ("train", "val", "test"):
            expected = np.bincount(labels[getattr(client, split)], minlength=bundle.num_classes).tolist()
            assert site["counts"][split] == expected, (site["name"], split)
    held = np.sum([s["counts"]["holdout"] for s in census["sites"]], axis=0)
    assert held.tolist() == np.bincount(labels[partition.global_test_indices], minlength=bundle.num_classes).tolist()
    png = census_heatmap(census, tmp_path / "census.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_site_read_only_its_own_folder_and_learned(own_files):
    """Each site's folder holds its client's images and the manifest only; its splits are prepared in its own state
    folder; the global model scores above chance (1/10) on the sites' held-out shares, each site's own test score above
    its chance (1/4); `fedpipe run` prints the sites by name and the census heatmap is drawn."""
    sites = own_files["work"] / "sites"
    for name in SITES:
        files = sites / name / "files"
        assert sorted(p.name for p in files.iterdir()) == ["fedpipe-data.yaml", name]
        assert list((sites / name / "state" / "prepared").glob("*.safetensors")), name
        assert "joining 127.0.0.1:" in own_files["logs"][name]  # `fedpipe site join` checked its data, then became the SuperNode
    summary = own_files["summary"]
    print(f"own files: global {summary['global_accuracy']:.3f}; per site "
          f"{ {n: round(s['accuracy'], 3) for n, s in summary['per_site'].items()} }")
    assert sorted(summary["per_site"]) == sorted(SITES) and summary["sites"] == len(SITES)
    assert summary["global_accuracy"] > 0.3
    assert all(s["accuracy"] > 0.3 for s in summary["per_site"].values())  # chance: 1/4 of a site's own four digits
    assert "hospital-a, hospital-b" in own_files["stdout"] and "global model" in own_files["stdout"]
    report = own_files["report"]
    assert f"report                 {report / 'report.html'}" in own_files["stdout"]
    for png in ("census.png", "rounds.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report / "report.html").read_text()
    assert all(name in page for name in SITES) and page.count("data:image/png;base64,") == 2


def test_the_global_model_is_published_and_the_next_run_gated_at_the_sites(own_files):
    """registry.name: the first run's global model is version 1 of the line (promoted: the first); the second run is
    gated against it: each site scored version 1's global model on its held-out share, and got exactly what it scored
    for the first run's model at that run's evaluation (the same model, the same samples: the sites really scored the
    promoted version). The version holds the global model for serving, no client's model, and the server's state."""
    from fedpipe.models.line import ModelLine

    line = ModelLine(open_store(str(own_files["store"])), "hospitals")
    assert line.versions() == [1, 2]
    first, second = line.record(1), line.record(2)
    assert first.decision["promoted"] and first.run_id.startswith("federated") and first.clients == ()
    assert "model line             hospitals version 1: promoted" in own_files["stdout"]
    assert second.decision["champion_version"] == 1 and second.decision["metric"] == "global_accuracy"
    assert "model line             hospitals version 2" in own_files["again"]
    for cid, scores in own_files["evaluation"].items():
        assert own_files["evaluation_2"][cid]["champion-holdout-accuracy"] == scores["holdout-accuracy"], cid
    assert second.decision["champion"] == pytest.approx(own_files["summary"]["global_accuracy"])
    assert line.promoted() == (2 if second.decision["promoted"] else 1)
    files = {k.rsplit("/", 1)[-1] for k in line.store.list(line.keys.version(1))}
    assert {"spec.json", "state.pt"} <= files and any(f.startswith("global.") for f in files)
    spec = json.loads(line.read(1, "spec.json", 2**20))
    assert spec["clients"] == {} and spec["normalisation"]["source"] == "fixed"


def test_a_site_serves_its_own_model(own_files):
    """`fedpipe site serve` exports the site's personalized model of its latest run where it is and registers it in a
    model line in its own folder (--register-only here: the HTTP server is `fedpipe models serve`'s, tested with it); the same predictor
    answers the site's raw test images with the site's model, as accurately as the site reported at the evaluation."""
    from fedpipe.models.line import ModelLine
    from fedpipe.serving.predictor import LinePredictor, ServeOptions

    name = "hospital-a"
    state = own_files["work"] / "sites" / name / "state"
    done = _fedpipe("site", "serve", "--state", str(state), "--register-only", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "version 1 of" in done.stderr
    again = _fedpipe("site", "serve", "--state", str(state), "--register-only", timeout=300)  # the same run: the same version
    assert again.returncode == 0 and "version 1 of" in again.stderr, again.stderr
    predictor = LinePredictor(ModelLine(open_store(str(state / "models")), name), None, ServeOptions(trust_unsigned=True))
    (prepared,) = (state / "prepared").glob("*.safetensors")
    t = safetensors.torch.load_file(str(prepared))
    raw = (t["test_x"] * 0.5 + 0.5) * 255  # the fixed standardisation undone: the pixels a caller sends
    answer = predictor.predict(name, raw)
    assert answer.model == "personalized" and answer.client == name
    accuracy = float((torch.from_numpy(answer.index) == t["test_y"]).double().mean())
    latest = own_files["evaluation_ui"]["0"]  # the site's latest run: the pipeline's (hospital-a is client 0)
    assert accuracy == pytest.approx(latest["accuracy"], abs=1.5 / len(t["test_y"]))


def test_the_pipeline_in_federation_mode_runs_at_the_sites(own_files):
    """The method's pipeline with engine_mode=federation, from kfp's local runner: the census task waited for the five
    sites the config names, the phase task ran its rounds at the sites and forwarded each to the run's telemetry with
    the number of sites that answered, the evaluate task wrote the report into the run's store (S3): it names the five
    sites, and the global model learned (above chance, 1/10)."""
    from fedpipe.run.run import Run

    cfg = own_files["from_ui"]
    store, layout = open_store(str(cfg.run.store)), Run(cfg).layout
    summary = json.loads(store.get(layout.report("summary.json")))
    assert sorted(summary["per_site"]) == sorted(SITES) and summary["sites"] == len(SITES) and summary["rounds"] == 2
    assert summary["global_accuracy"] > 0.2, summary["global_accuracy"]
    result = json.loads(store.get(f"{layout.run_id}/federation/result.json"))
    assert result["stage"] == "evaluate" and result["round"] == 2
    rounds = [json.loads(line) for line in store.get_text(layout.rounds("federation")).splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["clients"] == len(SITES) for r in rounds)
    assert all(r["extra"]["sites_answered"] == len(SITES) for r in rounds)
    census = next(own_files["artifacts"].rglob("census"))  # the census task's HTML artifact
    page = census.read_text()
    assert all(name in page for name in SITES) and "data:image/png;base64," in page
    from fedpipe.models.line import ModelLine  # the publish task: the global model, the first version of its line

    line = ModelLine(store, "hospitals-ui")
    (version,) = line.versions()
    record = line.record(version)
    assert record.run_id == layout.run_id and record.decision["promoted"] and line.promoted() == version and record.clients == ()


def test_a_private_census_releases_noised_counts_and_counts_them(own_files):
    """With privacy on (the benchmark's FedAvg run), each site releases its label counts through the Gaussian mechanism (std 3 here): whole,
    non-negative numbers near the exact counts (the plain run's census) but not them; the heatmap is drawn from them;
    the exact split sizes stay out of census.json; and the accountant spent the release once before the first round:
    the epsilon after the run's one round is that of the census (noise multiplier 3, sample rate 1) composed with the
    round's (noise multiplier 0.3, every site), as the report's privacy line says."""
    from fedpipe.engine.accounting import default_delta, epsilon_of

    exact, private = own_files["census"], own_files["private"]
    moved = 0
    for plain, noised in zip(exact["sites"], private["census"]["sites"]):
        assert plain["name"] == noised["name"] and noised["counts_noise"] == 3 and "samples" not in noised
        for split in ("train", "val", "test", "holdout"):
            got, want = noised["counts"][split], plain["counts"][split]
            assert all(isinstance(c, int) and c >= 0 for c in got)
            assert all(abs(g - w) <= 6 * 3 or w == 0 for g, w in zip(got, want)), (noised["name"], split, got, want)
            moved += sum(g != w for g, w in zip(got, want))
    assert moved > 0.5 * sum(len(s["counts"][k]) for s in exact["sites"] for k in ("train", "val", "test", "holdout"))
    assert private["heatmap"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (line,) = private["rounds"]
    delta = default_delta(len(SITES))
    assert line["privacy"]["epsilon"] == pytest.approx(epsilon_of("rdp", [[3.0, 1.0, 1], [0.3, 1.0, 1]], delta), rel=1e-9)
    assert line["privacy"]["epsilon"] > epsilon_of("rdp", [[0.3, 1.0, 1]], delta)  # the census counts
    assert private["summary"]["privacy"]["census_noise"] == 3
    assert f"{line['privacy']['epsilon']:.2f}" in own_files["bench"]  # the comparison table's epsilon column


def test_a_benchmark_compares_methods_across_the_federation(own_files):
    """`fedpipe run --benchmark fedavg --benchmark local` with engine.mode=federation: the benchmark pipeline's federation
    branch ran one census and each method as its own run at the same five sites, and printed one comparison table:
    FedAvg's global model, traffic and epsilon (private), Local's personalized models and no traffic at all."""
    table = own_files["bench"]
    assert "federated over 5 sites" in table, table
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| method") and not line.startswith("| ---")}
    assert set(rows) == {"fedavg", "local"}, table
    fedavg, local = rows["fedavg"], rows["local"]
    assert float(local[0].split("%")[0]) > 10 and float(fedavg[0].split("%")[0]) >= 0  # Local above chance (10 digits)
    assert fedavg[1] != "n/a" and local[1] == "n/a"  # Local has no global model
    assert float(fedavg[3]) > 0 and float(local[3]) == float(local[4]) == 0  # MB up: Local sends nothing either way
