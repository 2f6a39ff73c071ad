"""A federation as the charts deploy it, run in the project's image on this machine: the pods as podman containers.

`make images` builds the image with podman (Flower in /opt/flower, nginx for the filter). Here:

1. `helm template` renders charts/fedpipe with federation.enabled (free loopback ports for federation.fleetPort,
   controlPort and linkPort; the store on the S3 test server, moto, on 127.0.0.1; its credentials in the Secret the
   chart creates; signing on with the test's key) and charts/fedpipe-site once per site (3 hospitals of
   tests/own_data.py, superlink.address=127.0.0.1:<fleet port>, the site's files as a hostPath).
2. Each rendered container runs as a podman container with its rendered command, args, env and volume mounts
   (tests/federation_containers.py): `valueFrom.secretKeyRef` env is resolved from the test's own Secrets (the chart's
   rendered storage and signing Secrets, the TLS and CA Secret manifests that `fedpipe federation certs
   --kubernetes-secret` writes, a site key Secret per site made from `fedpipe site keygen` as `kubectl create secret
   generic --from-file` would); Secrets and ConfigMaps are written out as files and bind-mounted read-only at the
   rendered mountPaths, emptyDirs are tmpfs, PVCs are folders here, a hostPath is mounted as is: what the kubelet does.
   The rendered securityContext becomes `--user 1000:1000 --read-only --cap-drop ALL --security-opt no-new-privileges`
   (seccomp RuntimeDefault is podman's default). The SuperLink pod's two containers (`superlink`, `fleet-filter`) and
   the three site pods (`fedpipe site join`) run so, each site seeing only its own data folder (read-only) and its own
   state folder (writable).
3. An operator container (the image, same lockdown) registers the three site public keys through the CONTROL port
   (`fedpipe federation register`) and waits until the SuperLink lists the three nodes online.
4. `fedpipe compile` compiles the fedavg pipeline for the image with the federation flags the chart passes
   (`--federation-superlink`, `--federation-ca-secret` = the Secret holding only the CA certificate,
   federation.tls.caSecretName, `--federation-control-secret` = the Control API's token), and kfp's DockerRunner runs it
   through podman's Docker API with host networking, with the run parameter engine_mode=federation: config, census,
   the phase at the sites, evaluate, publish, each task in its own container. The ServerApp runs in the superlink
   container (its SuperExec subprocess) and meets the tasks in the run's store (S3).

What stands in for what:
- The task pods' Secret volume (kfp-kubernetes `secretAsVolume`, which the DockerRunner ignores): the Secret the
  compiled spec names is written out as files (all its keys, as the kubelet would) and bind-mounted read-only at the
  spec's mountPath through the DockerRunner's `mounts`. The tasks' secretAsEnv (store credentials, signing key) is the
  runner's `environment`, from the same rendered Secrets the SuperLink's env is resolved from.
- Networking: `--network host` (environment.md): every container is on this machine's loopback, so the SuperLink's
  127.0.0.1 is the host's and the sites dial 127.0.0.1:<fleet port>, the tasks 127.0.0.1:<control port> (no Services, no
  cluster DNS, no NetworkPolicy here). The one consequence for a rendered command line: the three SuperNodes would all
  bind their ClientApp I/O port on 127.0.0.1:9094 (`fedpipe site join --port`'s default; each pod has its own loopback
  in a cluster), so each site container gets `--port <free port>` appended to its rendered command. Nothing else is
  added or rewritten.
- The pipeline's config names no data.source: in federation mode the server side reads none of the sites' files.
- Not run: Kubernetes and KFP's backend, resource limits, probes, the NetworkPolicies (tests/deploy test them as
  rendered manifests), a GPU.

Checks: the report (summary.json in the S3 store, signature checked with the chart's signing key) names exactly the
3 sites and the global model is above chance; each site's container log shows it joined and trained, its state
folder holds its prepared splits, and it saw only its own folder; the fleet port refuses the Control API (the filter is
really in the path: the same call through the control port is Flower's 200 with the chart's token, fedpipe's 403
without it); the SuperLink container runs as uid 1000
with a read-only root. Measured on this 2-core machine: see the module's `print`s (`-s`).

This test fails, never skips, when podman, helm or the image is missing: `make images` builds the image.
"""

from __future__ import annotations

import json
import re
import secrets as random_secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from containers import REPO, built_image, podman, podman_service
from federation_containers import (
    Containers,
    PodContainer,
    config_maps_of,
    free_port,
    pod_spec,
    render,
    secret_manifest_file,
    secrets_of,
    wait_for_port,
)
from own_data import SITES, write_digit_folders

pytestmark = [pytest.mark.services, pytest.mark.timeout(900)]

MAIN_CHART, SITE_CHART = REPO / "charts" / "fedpipe", REPO / "charts" / "fedpipe-site"
RELEASE, NAMESPACE = "fedpipe", "fedpipe-test"
NAMES = SITES[:3]  # hospital-a, -b, -c: each holds four of the ten digits (tests/own_data.py)
BUCKET = "fedpipe-federation"
TLS_SECRET, CA_SECRET = "superlink-tls", "federation-ca"
RUN_ID = "federation-in-containers"
# The tiny run of tests/federation/test_own_files.py (OVERRIDES), two rounds.
OVERRIDES = ["method.name=fedavg", "data.dataset=files", "partition.scheme=natural", "data.standardisation=fixed",
             "model.name=twonn", "train.rounds=2", "train.local_epochs=1", "train.batch_size=20", "train.lr=0.05",
             "train.client_fraction=1.0", "engine.clients=sequential", "run.threads=1", "run.seed=0", "telemetry.progress=false"]


def _fedpipe(*args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, "-m", "fedpipe.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"fedpipe {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _post(port: int, path: str, ca: Path, token: str = "") -> tuple[int, str]:
    """(status, X-Fedpipe-Filter header) of an HTTPS POST to 127.0.0.1:port, trusting the federation's CA only (and, with
    `token`, sending the Control API's token, fedpipe.federation.control.HEADER)."""
    from fedpipe.federation.control import HEADER

    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data=b"", method="POST",
                                     headers={"Content-Type": "application/protobuf", **({HEADER: token} if token else {})})
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(ca)), timeout=20) as r:
            return r.status, r.headers.get("X-Fedpipe-Filter", "")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Fedpipe-Filter", "")


@pytest.fixture(scope="module")
def federation(s3_server, s3_credentials):
    """The SuperLink pod and three site pods as containers, the sites registered and online."""
    started = time.monotonic()
    image = built_image()
    repository, tag = image.rsplit(":", 1)
    exe = podman()
    # Not under pytest's tmp_path (0700, root's): the containers run as uid 1000 and read the data folders.
    work = Path(tempfile.mkdtemp(prefix="fedpipe-federation-containers-"))
    work.chmod(0o755)
    box = Containers(exe, f"fedpipe-fed-{random_secrets.token_hex(3)}")
    try:
        yield _start(box, work, image, repository, tag, s3_server, s3_credentials, started)
    finally:
        box.remove_all()
        shutil.rmtree(work, ignore_errors=True)


def _start(box: Containers, work: Path, image: str, repository: str, tag: str, s3_server: str, s3_credentials, started: float) -> dict:
    from minio import Minio

    fleet, control, link = free_port(), free_port(), free_port()
    access, secret = s3_credentials
    signing_key = random_secrets.token_hex(32)
    image_values = ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}"]
    main = render(MAIN_CHART, RELEASE, NAMESPACE, *image_values,
                  "--set", "federation.enabled=true", "--set", f"federation.tls.secretName={TLS_SECRET}",
                  "--set", f"federation.tls.caSecretName={CA_SECRET}",
                  "--set", f"federation.fleetPort={fleet}", "--set", f"federation.controlPort={control}",
                  "--set", f"federation.linkPort={link}", "--set", f"storage.endpoint={s3_server}",
                  # the runs' store, the only one the SuperLink's ServerApps may write to (FEDPIPE_SERVER_STORE)
                  "--set", f"runConfig.run.store=s3://{BUCKET}/runs",
                  "--set", "storage.createSecret=true", "--set", f"storage.accessKey={access}", "--set", f"storage.secretKey={secret}",
                  "--set", f"signing.key={signing_key}", "--set", "pushgateway.enabled=false",
                  "--set", "prometheusScrapeConfig.enabled=false")
    link_pod = pod_spec(main, "Deployment", "-superlink")
    conf = config_maps_of(main)[f"{RELEASE}-superlink-filter"]["nginx.conf"].decode()
    upstream_name = next(line.split()[1].rstrip(";") for line in conf.splitlines() if line.strip().startswith("proxy_ssl_name "))

    # The operator's certificates: the name nginx checks the SuperLink by (and 127.0.0.1, always added), as Secrets.
    certs = work / "certs"
    _fedpipe("federation", "certs", "--out", str(certs), "--host", upstream_name, "--kubernetes-secret", TLS_SECRET, "--ca-secret", CA_SECRET)
    ca = certs / "ca.crt"
    secrets = {**secrets_of(main), **secret_manifest_file(certs / f"{TLS_SECRET}.secret.yaml"),
               **secret_manifest_file(certs / "ca.secret.yaml")}

    # Each site: its own files (one hospital's folder and the manifest), its key pair; only NAME.pub reaches the operator.
    pooled = write_digit_folders(work / "pooled")
    from fedpipe.data.files.init import init_manifest, write_manifest

    manifest, _ = init_manifest(str(pooled))
    write_manifest(str(pooled), manifest)
    inbox = work / "operator-inbox"
    inbox.mkdir()
    site_pods, site_config_maps = {}, {}
    for name in NAMES:
        data = work / "sites" / name / "data"
        shutil.copytree(pooled / name, data / name)
        shutil.copy(pooled / "fedpipe-data.yaml", data / "fedpipe-data.yaml")
        for d in [work / "sites", work / "sites" / name, data]:
            d.chmod(0o755)
        keys = work / "keys" / name
        _fedpipe("site", "keygen", name, "--out", str(keys))
        shutil.copy(keys / f"{name}.pub", inbox / f"{name}.pub")
        secrets[f"{name}-key"] = {"site.key": (keys / f"{name}.key").read_bytes()}
        docs = render(SITE_CHART, name, f"site-{name}", *image_values,
                      "--set", f"site.name={name}", "--set", f"superlink.address=127.0.0.1:{fleet}",
                      "--set", f"superlink.caSecret.name={CA_SECRET}", "--set", f"siteKey.secretName={name}-key",
                      "--set", f"data.volume.hostPath={data}", "--set", "networkPolicy.superlinkPeers[0].ipBlock.cidr=127.0.0.1/32", cluster=False)
        site_pods[name] = pod_spec(docs, "Deployment", "")
        site_config_maps.update(config_maps_of(docs))  # the site's policy (its ConfigMap, mounted as the chart says)
    inbox.chmod(0o755)

    Minio(s3_server.removeprefix("http://"), access_key=access, secret_key=secret, secure=False, region="us-east-1").make_bucket(BUCKET)

    # The SuperLink pod: Flower on the pod's 127.0.0.1:<linkPort>, the filter on the fleet and control ports.
    prefix, names = box.prefix, {}
    for container in ("superlink", "fleet-filter"):
        c = PodContainer(link_pod, container, secrets, config_maps_of(main))
        assert c.spec["image"] == image, c.spec["image"]  # the chart names the image that runs here
        names[container] = box.run(c.podman_args(image, f"{prefix}-{container}", work / "superlink-pod"))
    wait_for_port(link, "the superlink container", lambda: box.stopped_log(names["superlink"]))
    wait_for_port(fleet, "the fleet-filter container (fleet port)", lambda: box.stopped_log(names["fleet-filter"]))
    wait_for_port(control, "the fleet-filter container (control port)", lambda: box.stopped_log(names["fleet-filter"]))

    # The operator registers the site keys through the control port, from a container of the image, with the Control
    # API's token copied out of the chart's Secret (as NOTES.txt says); its flwr calls send it (fedpipe.federation.control).
    token = work / "operator-control.token"
    token.write_bytes(secrets[f"{RELEASE}-superlink-control-token"]["token"])
    token.chmod(0o644)
    operator = box.run(["run", "-d", "--name", f"{prefix}-operator", "--network", "host", "--pull", "never", "--user", "1000:1000",
                        "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777", "--cap-drop", "ALL",
                        "--security-opt", "no-new-privileges", "-v", f"{inbox}:/inbox:ro", "-v", f"{certs / 'ca.crt'}:/ca/ca.crt:ro",
                        "-v", f"{token}:/control/token:ro", "-e", "FEDPIPE_CONTROL_TOKEN_FILE=/control/token",
                        image, "sleep", "infinity"])
    connection = (f'[superlink]\ndefault = "operator"\n\n[superlink.operator]\naddress = "127.0.0.1:{control}"\n'
                  'root-certificates = "/ca/ca.crt"\n')
    # Flower's CLI (the image's Flower environment) with the token, to list the nodes
    flwr = "FLWR_HOME=/tmp/flwr FLWR_TELEMETRY_ENABLED=0 /opt/flower/bin/python -m fedpipe.federation.control flwr"
    script = f"mkdir -p /tmp/flwr && printf '{connection}' > /tmp/flwr/config.toml && " + " && ".join(
        f"fedpipe federation register /inbox/{n}.pub --superlink 127.0.0.1:{control} --root-certificates /ca/ca.crt "
        "--ledger /tmp/federation-sites.json" for n in NAMES)
    registered = box.exec(operator, "sh", "-c", script, timeout=300)
    assert registered.returncode == 0, registered.stdout + registered.stderr + box.logs(names["fleet-filter"])[-3000:]
    node_ids = re.findall(r"registered as node (\d+)", registered.stdout)
    assert len(node_ids) == len(NAMES), registered.stdout

    # The three site pods. Host networking: each SuperNode needs its own ClientApp I/O port (module docstring).
    for name, pod in site_pods.items():
        c = PodContainer(pod, "supernode", secrets, site_config_maps, claims={})
        names[name] = box.run(c.podman_args(image, f"{prefix}-{name}", work / "site-pods" / name, ["--port", str(free_port())]))
        names[f"{name}-state"] = str(next(iter(c.claims.values())))
    deadline, table = time.monotonic() + 120, ""
    while time.monotonic() < deadline:
        listed = box.exec(operator, "sh", "-c", f"{flwr} supernode list operator --format json", timeout=120)
        table = listed.stdout + listed.stderr
        nodes = json.loads(listed.stdout[listed.stdout.index("{"):]).get("nodes", []) if "{" in listed.stdout else []
        if sorted(str(n.get("node-id")) for n in nodes if n.get("status") == "online") == sorted(map(str, node_ids)):
            break
        for name in NAMES:
            stopped = box.stopped_log(names[name])
            assert not stopped, f"site {name} stopped:\n{stopped}"
        time.sleep(2)
    else:
        raise AssertionError(f"the sites did not come online within 120 s:\n{table}\n" +
                             "\n".join(f"--- {n}:\n{box.logs(names[n])[-2000:]}" for n in NAMES))
    print(f"\nfederation up (SuperLink pod, 3 sites registered and online): {time.monotonic() - started:.0f} s")
    return {"box": box, "names": names, "work": work, "image": image, "ports": (fleet, control, link), "ca": ca,
            "secrets": secrets, "main": main, "registered": registered.stdout, "sites_table": table, "site_pods": site_pods,
            "s3": s3_server, "started": started}


def _task_secret_mounts(compiled: Path) -> list[tuple[str, str]]:
    """(Secret name, mountPath) of every secretAsVolume in the compiled pipeline's Kubernetes platform spec."""
    found = set()
    for doc in yaml.safe_load_all(compiled.read_text()):
        executors = ((doc or {}).get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {}))
        for executor in executors.values():
            for entry in executor.get("secretAsVolume", []):
                name = entry.get("secretName") or entry["secretNameParameter"]["runtimeValue"]["constant"]
                found.add((name, entry["mountPath"]))
    return sorted(found)


@pytest.fixture(scope="module")
def pipeline_run(federation, tmp_path_factory):
    """The fedavg pipeline compiled for the image with the chart's federation flags, run by kfp's DockerRunner with
    engine_mode=federation; returns the report's summary (read back through fedpipe's store with the signing key)."""
    import docker
    from kfp import components, local

    from fedpipe.run.config import load_config
    from fedpipe.store import open_store

    fed, work = federation, federation["work"]
    fleet, control, _ = fed["ports"]
    image, s3 = fed["image"], fed["s3"]
    repository, tag = image.rsplit(":", 1)
    storage, signing = fed["secrets"][f"{RELEASE}-storage"], fed["secrets"][f"{RELEASE}-signing"]
    task_env = {"AWS_ACCESS_KEY_ID": storage["accesskey"].decode(), "AWS_SECRET_ACCESS_KEY": storage["secretkey"].decode(),
                "FEDPIPE_SIGNING_KEY": signing["key"].decode(),
                # as the compiled federation tasks set it (pipelines/builder.py `_federation_step`), for a runner that
                # does not apply a task's own env
                "FEDPIPE_CONTROL_TOKEN_FILE": "/etc/fedpipe/federation-control/token"}
    compiled = work / "fedavg.yaml"
    _fedpipe("compile", "-o", str(compiled), "--set", "method.name=fedavg", "--image-repository", repository, "--image-tag", tag,
             "--training-image-tag", tag, "--accelerator-count", "0", "--store", f"s3://{BUCKET}/runs", "--s3-endpoint", s3,
             "--signing-secret", f"{RELEASE}-signing", "--federation-superlink", f"127.0.0.1:{control}",
             "--federation-ca-secret", CA_SECRET, "--federation-control-secret", f"{RELEASE}-superlink-control-token")
    # The Secret volumes the compiled tasks ask for, as the kubelet would mount them (module docstring): the CA alone (a
    # task pod never gets the SuperLink's key) and the Control API's token.
    mounts = dict(_task_secret_mounts(compiled))
    assert sorted(mounts) == sorted([CA_SECRET, f"{RELEASE}-superlink-control-token"]), mounts
    mount_path = mounts[CA_SECRET]
    volumes = {}
    for secret_name, path in mounts.items():
        volume = volumes[path] = work / f"task-secret-volume-{secret_name}"
        volume.mkdir()
        for key, value in fed["secrets"][secret_name].items():
            (volume / key).write_bytes(value)
            (volume / key).chmod(0o644)
        volume.chmod(0o755)

    # The run's config: no data.source (the sites hold the data).
    env = {"FEDPIPE_S3_ENDPOINT": s3, "AWS_REGION": "us-east-1", **task_env}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        cfg = load_config(None, [*OVERRIDES, "engine.mode=federation",
                                 f"federation.site_names=[{','.join(NAMES)}]", f"federation.superlink=127.0.0.1:{control}",
                                 f"federation.root_certificates={mount_path}/ca.crt", f"run.store=s3://{BUCKET}/runs",
                                 f"run.id={RUN_ID}", "federation.connect_timeout=120", "federation.round_timeout=120"])
        pipeline = components.load_component_from_file(str(compiled))
        root = work / "kfp-root"
        root.mkdir(mode=0o777)
        root.chmod(0o777)  # the image's user (1000) writes the task outputs into this folder
        started = time.monotonic()
        with podman_service() as socket_url:
            mp.setenv("DOCKER_HOST", socket_url)  # kfp's DockerRunner calls docker.from_env()
            runner = local.DockerRunner(network_mode="host", environment=task_env,
                                        mounts=[docker.types.Mount(target=path, source=str(volume), type="bind", read_only=True)
                                                for path, volume in volumes.items()])
            local.init(runner=runner, pipeline_root=str(root), raise_on_error=True)
            try:
                pipeline(base_config=cfg.to_yaml(), engine_mode="federation", accelerator_count="0")
            except Exception as e:
                logs = "\n".join(f"--- {n}:\n{fed['box'].logs(c)[-3000:]}" for n, c in fed["names"].items() if not n.endswith("-state"))
                raise AssertionError(f"the pipeline failed: {e}\n{logs}") from None
        took = time.monotonic() - started
        summary = json.loads(open_store(f"s3://{BUCKET}/runs").get(f"{RUN_ID}/report/summary.json"))
    print(f"\npipeline in federation mode, every task a container: {took:.0f} s; "
          f"whole fixture: {time.monotonic() - fed['started']:.0f} s")
    [run_dir] = [p for p in root.iterdir() if p.is_dir()]
    return {"summary": summary, "run_dir": run_dir, "took": took}


# --- the checks ------------------------------------------------------------------------------------------------------


def test_the_fleet_port_refuses_the_control_api(federation):
    """The filter is in the path: through the sites' fleet port the Control API is the filter's 404, while the same call
    through the control port reaches the SuperLink: with the chart's token Flower's 200, without it fedpipe's 403."""
    fleet, control, _ = federation["ports"]
    token = federation["secrets"][f"{RELEASE}-superlink-control-token"]["token"].decode()
    assert _post(fleet, "/v1/control/list-nodes", federation["ca"], token) == (404, "refused")
    assert _post(control, "/v1/control/list-nodes", federation["ca"], token) == (200, "")
    assert _post(control, "/v1/control/list-nodes", federation["ca"]) == (403, "")


def test_the_superlink_runs_as_uid_1000_with_a_read_only_root(federation):
    box, name = federation["box"], federation["names"]["superlink"]
    info = box.inspect(name)
    assert info["Config"]["User"] == "1000:1000" and info["HostConfig"]["ReadonlyRootfs"] is True
    status = box.exec(name, "cat", "/proc/1/status").stdout
    assert next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:] == ["1000"] * 4, status
    assert next(line for line in status.splitlines() if line.startswith("CapEff:")).split()[1] == "0" * 16, status
    denied = box.exec(name, "touch", "/opt/flower/x")
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied.stderr
    # the SuperLink process itself, started with the chart's flags
    command = box.exec(name, "cat", "/proc/1/cmdline").stdout.split("\0")
    assert "--enable-supernode-auth" in command and "--host=127.0.0.1" in command, command


def test_the_pipeline_report_names_the_three_sites(pipeline_run):
    summary = pipeline_run["summary"]
    print(f"federated over 3 site containers: global {summary['global_accuracy']:.3f}; per site "
          f"{ {n: round(s['accuracy'], 3) for n, s in summary['per_site'].items()} }")
    assert sorted(summary["per_site"]) == sorted(NAMES) and summary["sites"] == len(NAMES) and summary["rounds"] == 2
    # chance: 1/8 (the three hospitals hold the digits 0-7 between them)
    assert summary["global_accuracy"] > 0.25, summary
    tasks = sorted(p.name for p in pipeline_run["run_dir"].iterdir())
    assert any(t.startswith("federated-census") for t in tasks) and any(t.startswith("federated-evaluate") for t in tasks), tasks


def test_each_site_trained_on_its_own_folder_only(federation, pipeline_run):
    box, names, work = federation["box"], federation["names"], federation["work"]
    for name in NAMES:
        log = box.logs(names[name])
        assert "joining 127.0.0.1:" in log, log[-3000:]  # `fedpipe site join` checked its files, then became the SuperNode
        assert len(re.findall(r"Receiving: train message", log)) >= 2, log[-3000:]  # both rounds trained here
        state = Path(names[f"{name}-state"])
        assert list((state / "prepared").glob("*.safetensors")), name  # its splits, made at the site
        data_mounts = [m for m in box.inspect(names[name])["Mounts"] if m["Destination"] == "/data"]
        assert [m["Source"] for m in data_mounts] == [str(work / "sites" / name / "data")] and not data_mounts[0]["RW"]
        others = [str(work / "sites" / other) for other in NAMES if other != name]
        assert not [m for m in box.inspect(names[name])["Mounts"] if any(m["Source"].startswith(o) for o in others)]
