"""charts/fedpipe's federation server side (federation.enabled): a Flower 1.42 SuperLink on the pod's 127.0.0.1 behind
a filter (nginx) that gives sites the Fleet API only, rendered by the real `helm`.

What each test shows:
- off by default, nothing is rendered (the default render is untouched); on, every variant validates against
  Kubernetes 1.30's and 1.34's schemas (kubernetes-validate) and `helm lint --strict` passes;
- the cert-manager Certificate validates against cert-manager v1.21.1's own CRD schema (vendored,
  tests/deploy/schemas/README.md), closed so that a misspelt field fails;
- wrong values are refused by name: by the values schema, and by the chart's cross-field checks (exactly one source of
  TLS, an issuer for cert-manager);
- the pod is locked down like the chart's other pods; the SuperLink gets the store and signing env the pipeline's tasks
  get (pipelines/builder.py), its state on a kept volume; the NetworkPolicy admits sites to the fleet port and the
  pipeline's task pods to the control port only;
- every call Flower 1.42's own clients make passes the filter's path rule;
- the real thing (`-m services`: nginx from scripts/test-services.sh): the real nginx with the chart's nginx.conf in
  front of a real `flower-superlink` started with the chart's flags. Through the fleet port the Control API is refused by
  the filter while a Fleet call reaches Flower; the control port passes the Control API and refuses the Fleet API; and a
  real `flower-supernode`, its key registered through the control port, activates through the fleet port.

Upstream facts relied on (Flower 1.42.0, .cache/flower-venv/lib/python3.11/site-packages/flwr): one FastAPI app serves
the health, control (prefix /v1/control), fleet (prefix /v1/fleet) and runtime routers (superlink/main.py,
`fastapi_app.include_router`); `GET /health` answers 200 (supercore/routers/health/router.py); the SuperNode's Fleet
client POSTs to fixed paths /v1/fleet/<call> (supernode/fleet_http_client.py) with a 30 s default timeout
(supercore/protobuf/client.py). nginx 1.22 (Debian bookworm's nginx-light): proxy_ssl_verify checks the upstream's
certificate by proxy_ssl_name, a DNS name.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from deploytools import (
    CHART,
    CLUSTER,
    K8S_SPAN,
    NAMESPACE,
    RELEASE,
    crd_schema_problems,
    only,
    parse_docs,
    run_tool,
    schema_rejection,
)

from fedpipe.store import s3 as s3_store

CERT_MANAGER_SCHEMA = Path(__file__).resolve().parent / "schemas" / "cert-manager.io_certificates.v1.cert-manager-v1.21.1.json"
ON = ["--set", "federation.enabled=true", "--set", "federation.tls.caSecretName=federation-ca"]
TLS_SECRET = [*ON, "--set", "federation.tls.secretName=superlink-tls", "--set", "federation.tls.extraDnsNames={fl.example.org}"]
CERT_MANAGER = [*ON, "--set", "federation.tls.certManager.enabled=true", "--set", "federation.tls.certManager.issuerRef.name=federation-ca",
                "--set", "federation.tls.extraDnsNames={fl.example.org}"]
VARIANTS = {
    "tls-secret": TLS_SECRET,
    "cert-manager": CERT_MANAGER,
    "load-balancer-from-sites": [*TLS_SECRET, "--set", "federation.service.type=LoadBalancer", "--set", "federation.service.nodePort=31092",
                                 "--set", "federation.service.loadBalancerSourceRanges={203.0.113.0/24}",
                                 "--set", "federation.siteSources={203.0.113.7/32,198.51.100.0/24}",
                                 "--set-string", "federation.service.annotations.lb\\.example\\.org/internal=false"],
    "profile-namespace-existing-claim-no-policy": [*CERT_MANAGER, "--set", "kubeflow.namespace=team-a", "--set", "networkPolicy.enabled=false",
                                                   "--set", "federation.persistence.existingClaim=superlink-state", "--set", "signing.enabled=false"],
}  # fmt: skip
SUPERLINK = f"{RELEASE}-superlink"
CONTROL = f"{RELEASE}-superlink-control"


def superlink_docs(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "superlink"]


def nginx_conf(docs: list[dict]) -> str:
    return only(docs, "ConfigMap", "-superlink-filter")["data"]["nginx.conf"]


def pod_of(docs: list[dict]) -> dict:
    return only(docs, "Deployment", "-superlink")["spec"]["template"]["spec"]


def container(docs: list[dict], name: str) -> dict:
    (found,) = [c for c in pod_of(docs)["containers"] if c["name"] == name]
    return found


# --- rendering ------------------------------------------------------------------------------------------------------


def test_off_by_default_nothing_is_rendered(render_chart, helm):
    key = ["--set", "signing.key=" + "k" * 32]  # a fixed key: a generated one differs between two renders
    default = render_chart(*key)
    assert not superlink_docs(default) and not [d for d in default if "superlink" in d["metadata"]["name"]]
    # Federation values change nothing while federation.enabled is false.
    assert render_chart(*key, *TLS_SECRET[2:], "--set", "federation.siteSources={203.0.113.7/32}") == default
    notes = run_tool([helm, "install", RELEASE, str(CHART), "--dry-run=client", "-n", NAMESPACE, *CLUSTER]).stdout
    assert "SuperLink" not in notes and "superlink" not in notes


@pytest.mark.parametrize("variant", ["tls-secret", "cert-manager"])
def test_helm_lint_strict_passes(helm, variant):
    proc = run_tool([helm, "lint", "--strict", str(CHART), *CLUSTER, *VARIANTS[variant]])
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_validates_against_kubernetes(render_chart, validate_k8s, variant):
    docs = render_chart(*VARIANTS[variant])
    mine = superlink_docs(docs)
    kinds = sorted(d["kind"] for d in mine)
    expected = ["ConfigMap", "Deployment", "Secret", "Service", "Service"]  # the Secret: the Control API's token
    expected += ["PersistentVolumeClaim"] if "existing-claim" not in variant else []
    expected += ["Certificate"] if "certManager.enabled=true" in " ".join(VARIANTS[variant]) else []
    expected += ["NetworkPolicy", "NetworkPolicy"] if "no-policy" not in variant else []
    assert kinds == sorted(expected), kinds
    # kubernetes-validate has no schema for cert-manager's kind: the Certificate is checked against its CRD below.
    validate_k8s([d for d in docs if d["kind"] != "Certificate"], K8S_SPAN)
    namespace = "team-a" if "profile-namespace" in variant else NAMESPACE
    assert {d["metadata"]["namespace"] for d in mine} == {namespace}  # with the runs' Secrets


def test_the_certificate_is_cert_managers_and_names_what_is_dialled(render_chart):
    docs = render_chart(*CERT_MANAGER)
    cert = only(docs, "Certificate", "-superlink")
    assert crd_schema_problems(CERT_MANAGER_SCHEMA, cert) == []
    # The closed schema bites: a misspelt field and a wrong type are refused.
    misspelt = {**cert, "spec": {**cert["spec"], "dnsName": cert["spec"]["dnsNames"]}}
    assert any("dnsName" in p for p in crd_schema_problems(CERT_MANAGER_SCHEMA, misspelt))
    assert crd_schema_problems(CERT_MANAGER_SCHEMA, {**cert, "spec": {**cert["spec"], "ipAddresses": "127.0.0.1"}})
    spec = cert["spec"]
    for service in (SUPERLINK, CONTROL):
        assert {service, f"{service}.{NAMESPACE}", f"{service}.{NAMESPACE}.svc"} <= set(spec["dnsNames"])
    assert "fl.example.org" in spec["dnsNames"] and spec["ipAddresses"] == ["127.0.0.1"]  # the SuperExec dials 127.0.0.1
    assert spec["issuerRef"] == {"name": "federation-ca", "kind": "Issuer", "group": "cert-manager.io"}
    volumes = {v["name"]: v for v in pod_of(docs)["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == spec["secretName"] == f"{SUPERLINK}-tls"
    # nginx checks the SuperLink's certificate on 127.0.0.1 by a DNS name the certificate holds.
    name = re.search(r"proxy_ssl_name (\S+);", nginx_conf(docs))[1]
    assert name == f"{SUPERLINK}.{NAMESPACE}.svc" and name in spec["dnsNames"]


@pytest.mark.parametrize("values, named", [
    ({"federation": {"enabled": "yes"}}, "federation.enabled"),
    ({"federation": {"fleetPort": 70000}}, "federation.fleetPort"),
    ({"federation": {"siteSources": ["203.0.113.7"]}}, "federation.siteSources"),
    ({"federation": {"service": {"type": "ExternalName"}}}, "federation.service.type"),
    ({"federation": {"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}}, "federation.tls.certManager.issuerRef.kind"),
    ({"federation": {"tls": {"extraDnsNames": ["https://fl.example.org"]}}}, "federation.tls.extraDnsNames"),
    ({"federation": {"filter": {"maxBodySize": "half a gig"}}}, "federation.filter.maxBodySize"),
    ({"federation": {"filter": {"timeoutSeconds": 10}}}, "federation.filter.timeoutSeconds"),
    ({"federation": {"tls": {"secretname": "x"}}}, "secretname"),
])  # fmt: skip
def test_the_schema_names_a_wrong_value(helm, tmp_path, values, named):
    stderr = schema_rejection(helm, tmp_path, values)
    assert named in stderr, stderr


@pytest.mark.parametrize("args, message", [
    (ON, "federation.tls: name exactly one of"),
    ([*TLS_SECRET, "--set", "federation.tls.certManager.enabled=true"], "federation.tls: name exactly one of"),
    ([*ON, "--set", "federation.tls.certManager.enabled=true"], "federation.tls.certManager.issuerRef.name"),
    ([*TLS_SECRET, "--set", "federation.tls.caSecretName="], "federation.tls.caSecretName: name a Secret holding only ca.crt"),
])  # fmt: skip
def test_values_that_only_work_together_fail_with_a_message(helm, args, message):
    proc = run_tool([helm, "template", RELEASE, str(CHART), *CLUSTER, *args], check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("variant", ["tls-secret", "cert-manager"])
def test_the_pod_is_locked_down(render_chart, variant):
    """Non-root with seccomp, read-only root, no capabilities, no service account token, requests and limits, /tmp an
    emptyDir in each container; the TLS key readable by the pod's group only; one replica, replaced not rolled."""
    docs = render_chart(*VARIANTS[variant])
    deployment = only(docs, "Deployment", "-superlink")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = pod_of(docs)
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["defaultMode"] == 0o440
    assert [c["name"] for c in pod["containers"]] == ["superlink", "fleet-filter"] and "initContainers" not in pod
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["runAsUser"] > 0 and sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in sc
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(c["resources"]["limits"])
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]], c["name"]
        assert mounts["/etc/fedpipe/tls"]["readOnly"] is True
        assert c["image"].startswith("ghcr.io/fedpipe/fedpipe:")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["sidecar.istio.io/inject"] == "false" and "checksum/filter-config" in annotations


def test_the_superlink_runs_on_loopback_with_the_tasks_env_and_kept_state(render_chart):
    docs = render_chart(*TLS_SECRET, "--set", "storage.existingSecret=team-s3", "--set", "storage.accessKeyKey=AK")
    link = container(docs, "superlink")
    # Flower's flower-superlink, its Control API behind fedpipe's token check (fedpipe.federation.control)
    assert link["command"] == ["/opt/flower/bin/python", "-m", "fedpipe.federation.control", "superlink", "--"]
    args = link["args"]
    assert {"--enable-supernode-auth", "--host=127.0.0.1", "--port=9093", "--isolation=subprocess",
            "--disable-runtime-dependency-installation", "--ssl-ca-certfile=/etc/fedpipe/tls/ca.crt",
            "--ssl-certfile=/etc/fedpipe/tls/tls.crt", "--ssl-keyfile=/etc/fedpipe/tls/tls.key"} <= set(args)
    assert "--database=/var/lib/superlink/superlink.db" in args
    assert {m["mountPath"]: m["name"] for m in link["volumeMounts"]}["/var/lib/superlink"] == "state"
    assert "ports" not in link  # nothing of the SuperLink's own is exposed
    env = {e["name"]: e for e in link["env"]}
    # The names fedpipe's store reads (fedpipe/store/s3.py) and the pipeline's tasks get (pipelines/builder.py).
    assert env[s3_store.ENV_ENDPOINT]["value"] == "http://minio-service.kubeflow:9000"
    assert env[s3_store.ENV_ACCESS_KEY]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "AK"}
    assert env[s3_store.ENV_SECRET_KEY]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "secretkey"}
    assert env["FEDPIPE_SIGNING_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-signing", "key": "key"}
    assert env["FLWR_TELEMETRY_ENABLED"]["value"] == "0"
    # the ServerApps write only into the runs' store, whatever store a submitted run config names (fedpipe.federation.places)
    assert env["FEDPIPE_SERVER_STORE"]["value"] == "s3://mlpipeline/fedpipe" and "FEDPIPE_SERVER_ROOT" not in env
    assert env["HOME"]["value"] == "/tmp" and env["FLWR_HOME"]["value"].startswith("/tmp/")
    claim = only(docs, "PersistentVolumeClaim", "-superlink-state")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # registered sites survive an uninstall
    assert {v["name"]: v for v in pod_of(docs)["volumes"]}["state"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    unsigned = {e["name"] for e in container(render_chart(*TLS_SECRET, "--set", "signing.enabled=false"), "superlink")["env"]}
    assert "FEDPIPE_SIGNING_KEY" not in unsigned


def test_the_control_api_takes_a_token_that_only_the_superlink_and_the_federation_tasks_mount(render_chart):
    """Flower 1.42's Control API checks no credential (docs/security.md, "The Control API"), and the chart's control port
    admits any pod with the task labels: so the SuperLink asks every Control API call for the token in the control
    Secret (fedpipe.federation.control), which the chart makes with a random token, mounts into the SuperLink (mode
    0440, named by FEDPIPE_CONTROL_TOKEN_FILE) and names to the registration Job for the federation tasks only; no other
    pod of the chart mounts it. With controlToken.existingSecret that Secret is used and none is made. On today's main
    no such Secret exists and the SuperLink is Flower's own, unguarded."""
    import base64

    docs = render_chart(*TLS_SECRET)
    secret = only(docs, "Secret", "-superlink-control-token")
    assert secret["metadata"]["name"] == f"{CONTROL}-token"
    assert len(base64.b64decode(secret["data"]["token"])) >= 48
    link = container(docs, "superlink")
    env = {e["name"]: e for e in link["env"]}
    assert env["FEDPIPE_CONTROL_TOKEN_FILE"]["value"] == "/etc/fedpipe/control/token"
    mounts = {m["mountPath"]: m for m in link["volumeMounts"]}
    assert mounts["/etc/fedpipe/control"]["readOnly"] is True
    volume = {v["name"]: v for v in pod_of(docs)["volumes"]}[mounts["/etc/fedpipe/control"]["name"]]
    assert volume["secret"] == {"secretName": f"{CONTROL}-token", "defaultMode": 0o440}
    users = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs if f"{CONTROL}-token" in json.dumps(d) and d is not secret)
    assert users == [f"Deployment/{SUPERLINK}", f"Job/{RELEASE}-register"], users
    job = only(docs, "Job", "-register")
    assert f"--federation-control-secret={CONTROL}-token" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "/etc/fedpipe/control" not in json.dumps(container(docs, "fleet-filter"))  # the filter never holds it
    own = render_chart(*TLS_SECRET, "--set", "federation.controlToken.existingSecret=ops-control")
    assert not [d for d in own if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-control-token")]
    assert {v["name"]: v for v in pod_of(own)["volumes"]}["control"]["secret"]["secretName"] == "ops-control"


def test_the_filter_is_the_only_listener_and_its_services(render_chart):
    docs = render_chart(*VARIANTS["load-balancer-from-sites"])
    filt = container(docs, "fleet-filter")
    assert filt["command"] == ["/usr/sbin/nginx", "-c", "/etc/fedpipe/filter/nginx.conf", "-e", "stderr"]
    assert {p["name"]: p["containerPort"] for p in filt["ports"]} == {"fleet": 9092, "control": 9091}
    assert filt["readinessProbe"]["httpGet"] == {"scheme": "HTTPS", "path": "/health", "port": "control"}
    assert filt["livenessProbe"]["tcpSocket"] == {"port": "fleet"}
    fleet = only(docs, "Service", "-superlink")["spec"]
    assert fleet["type"] == "LoadBalancer" and fleet["loadBalancerSourceRanges"] == ["203.0.113.0/24"]
    assert fleet["ports"] == [{"name": "fleet", "port": 9092, "targetPort": "fleet", "protocol": "TCP", "nodePort": 31092}]
    control = only(docs, "Service", "-superlink-control")["spec"]
    assert control["type"] == "ClusterIP" and [p["targetPort"] for p in control["ports"]] == ["control"]
    conf = nginx_conf(docs)
    assert "server 127.0.0.1:9093;" in conf and "listen 9092 ssl;" in conf and "listen 9091 ssl;" in conf
    assert "client_max_body_size 512m;" in conf and "proxy_read_timeout 300s;" in conf and "proxy_ssl_verify on;" in conf


def test_the_network_policy_admits_sites_to_fleet_and_tasks_to_control_only(render_chart):
    docs = render_chart(*VARIANTS["load-balancer-from-sites"])
    policy = only(docs, "NetworkPolicy", "-superlink")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "superlink"
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    fleet, control = policy["ingress"]
    assert fleet["ports"] == [{"protocol": "TCP", "port": 9092}]
    assert fleet["from"] == [{"ipBlock": {"cidr": "203.0.113.7/32"}}, {"ipBlock": {"cidr": "198.51.100.0/24"}}]
    assert control["ports"] == [{"protocol": "TCP", "port": 9091}]
    # the pipeline's task pods (builder.POD_LABEL, KFP's v2_component label), in the SuperLink's namespace only
    assert control["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "fedpipe",
                                                                "pipelines.kubeflow.org/v2_component": "true"}}}]
    egress_ports = sorted(p["port"] for rule in policy["egress"] for p in rule["ports"])
    assert egress_ports == [53, 53, 9000, 9091]  # DNS, the store, the chart's Pushgateway; never out to anything else
    tasks = only(docs, "NetworkPolicy", "-superlink-control-egress")["spec"]
    assert tasks["egress"] == [{"to": [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}],
                                "ports": [{"protocol": "TCP", "port": 9091}]}]
    anywhere = only(render_chart(*TLS_SECRET), "NetworkPolicy", "-superlink")["spec"]["ingress"][0]
    assert "from" not in anywhere  # no siteSources: sites from anywhere, to the fleet port only


def test_notes_say_how_sites_reach_it(helm):
    notes = run_tool([helm, "install", RELEASE, str(CHART), "--dry-run=client", "-n", NAMESPACE, *CLUSTER, *TLS_SECRET]).stdout
    for part in (f"{SUPERLINK}.{NAMESPACE}.svc:9092", "fl.example.org:9092", "fedpipe federation register hospital-a.pub",
                 "helm install", "charts/fedpipe-site", "superlink.address=fl.example.org:9092", f"svc/{CONTROL}",
                 f"get secret {CONTROL}-token", "FEDPIPE_CONTROL_TOKEN_FILE"):
        assert part in notes, notes


def _flower_source(env: Path, module: str) -> str:
    found = sorted(env.glob(f"lib/python3*/site-packages/flwr/{module}"))
    if not found:
        pytest.fail(f"flwr/{module} not found in the Flower environment {env}: run scripts/flower-env.sh", pytrace=False)
    return found[0].read_text()


def _flower_paths(env: Path, module: str) -> set[str]:
    return set(re.findall(r'path="(/v1/[^"]*)"', _flower_source(env, module)))


def test_every_call_of_flowers_clients_passes_the_filters_path_rule(render_chart, flower_env):
    """The filter passes a request line only when it is exactly /v1/fleet/<call> (or /v1/control/<call>) with <call> in
    [a-z0-9-]: each path Flower 1.42's SuperNode (supernode/fleet_http_client.py) and `flwr` CLI (the Control API's
    routes, superlink/routers/control/router.py) use matches; nothing with a dot segment, an escape or a query does."""
    conf = nginx_conf(render_chart(*TLS_SECRET))
    fleet_rule = re.search(r'\$request_uri !~ "(\^/v1/fleet/[^"]+)"', conf)[1]
    control_rule = re.search(r'\$request_uri !~ "(\^/v1/control/[^"]+)"', conf)[1]
    fleet = _flower_paths(flower_env, "supernode/fleet_http_client.py")
    assert len(fleet) >= 10 and all(p.startswith("/v1/fleet/") for p in fleet), fleet
    assert all(re.match(fleet_rule, p) for p in fleet), [p for p in fleet if not re.match(fleet_rule, p)]
    control = {"/v1/control" + p for p in re.findall(r'@router\.post\("(/[^"]+)"\)', _flower_source(flower_env, "superlink/routers/control/router.py"))}
    assert len(control) >= 20 and all(re.match(control_rule, p) for p in control)
    for sneaky in ("/v1/fleet/../control/list-nodes", "/v1/fleet/%2e%2e/control/list-nodes", "/v1/fleet//x",
                   "/v1/fleet/get-run?x=1", "/v1/fleet/"):
        assert not re.match(fleet_rule, sneaky), sneaky


# --- the real filter in front of the real SuperLink -------------------------------------------------------------------


def _post(port: int, path: str, ca: Path, body: bytes = b"", method: str = "POST", token: str = "") -> tuple[int, str, str]:
    """(status, X-Fedpipe-Filter header, body) of an HTTPS request to 127.0.0.1:port, the CA's trust only (and, with
    `token`, the Control API's token, fedpipe.federation.control.HEADER)."""
    from fedpipe.federation.control import HEADER

    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data=body if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/protobuf", **({HEADER: token} if token else {})})
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(request, context=context, timeout=20) as r:
            return r.status, r.headers.get("X-Fedpipe-Filter", ""), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Fedpipe-Filter", ""), e.read().decode(errors="replace")


def _as_here(text: str, paths: dict[str, str]) -> str:
    for chart_path, here in paths.items():
        text = text.replace(chart_path, here)
    return text


@pytest.fixture(scope="module")
def live_filter(helm, flower_env):
    """The chart's SuperLink pod on this machine: `flower-superlink` with the rendered container's args, and the real
    nginx with the rendered nginx.conf. The chart is rendered with free loopback ports for federation.fleetPort,
    controlPort and linkPort (so no port is rewritten); only file paths are: the TLS Secret's mount
    (/etc/fedpipe/tls/...) becomes make_tls's files (the CA, and a certificate for 127.0.0.1 and the fleet Service's
    .svc name, as the chart requires), /tmp/ (the emptyDirs) and the state volume become folders here. Run as root
    here, nginx runs as nobody (setpriv), as the pod runs it non-root."""
    import shutil

    from services import find_binary

    from fedpipe.federation.certs import make_tls
    from fedpipe.federation.control import make_token
    from fedpipe.federation.tryout import CONNECTION, LoopbackFederation, free_port, write_connection

    nginx = find_binary("nginx")
    env = flower_env  # built (or reused) by the session fixture (tests/conftest.py)
    fleet, control, link = free_port(), free_port(), free_port()
    docs = parse_docs(run_tool([helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *CLUSTER, *TLS_SECRET,
                                "--set", f"federation.fleetPort={fleet}", "--set", f"federation.controlPort={control}",
                                "--set", f"federation.linkPort={link}"]).stdout)
    # Not under pytest's tmp_path: its root is private to this user (0700), and nginx runs as another one here.
    work = Path(tempfile.mkdtemp(prefix="fedpipe-superlink-"))
    work.chmod(0o755)
    fed = LoopbackFederation(work, env)
    fed.tls = make_tls(fed.certs, hosts=("127.0.0.1", f"{SUPERLINK}.{NAMESPACE}.svc"))
    for path in [fed.certs, *fed.tls.values()]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # nginx's user reads them (the pod's group does, mode 0440)
    filter_tmp, link_tmp, state = work / "filter-tmp", work / "tmp", work / "state"
    for folder in (filter_tmp, link_tmp, state):
        folder.mkdir()
    filter_tmp.chmod(0o777)
    paths = {"/etc/fedpipe/tls/tls.crt": str(fed.tls["server_cert"]), "/etc/fedpipe/tls/tls.key": str(fed.tls["server_key"]),
             "/etc/fedpipe/tls/ca.crt": str(fed.tls["ca_cert"])}
    conf = work / "nginx.conf"
    conf.write_text(_as_here(re.sub(r"(?<= )/tmp/", f"{filter_tmp}/", nginx_conf(docs)), paths))  # the emptyDir first
    link_container = container(docs, "superlink")
    link_args = [_as_here(a, {**paths, "/var/lib/superlink/": f"{state}/"}) for a in link_container["args"]]
    # the chart's command: Flower's SuperLink behind fedpipe's Control API token check, the token from the control Secret
    link_command = [_as_here(a, {"/opt/flower/bin/": f"{env}/bin/"}) for a in link_container["command"]]
    fed.token = make_token(work / "control")  # the Secret's token file; fed's own flwr calls send it
    write_connection(fed.home, CONNECTION, f"127.0.0.1:{control}", fed.tls["ca_cert"])
    fed.port = fleet  # where fed.start_site's SuperNodes dial: the fleet port of the filter
    drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"] if os.geteuid() == 0 else []
    (work / "logs").mkdir()
    log = work / "logs" / "filter.log"
    log.touch()
    if drop:
        shutil.chown(log, 65534, 65534)  # nginx opens /dev/stdout (its access log) as its own user, as in a pod
    try:
        fed._spawn("superlink", [*link_command, *link_args], {"HOME": str(link_tmp)}, control=True)
        fed._wait_port(link, "superlink")
        fed._spawn("filter", [*drop, nginx, "-c", str(conf), "-e", "stderr"])
        fed._wait_port(fleet, "filter")
        fed._wait_port(control, "filter")
        yield {"fed": fed, "fleet": fleet, "control": control, "link": link, "ca": fed.tls["ca_cert"], "conf": conf,
               "nginx": nginx, "args": link_args, "token": fed.token.read_text().strip()}
    finally:
        fed.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.services
def test_the_real_filter_gives_sites_the_fleet_api_only(live_filter):
    fleet, control, ca = live_filter["fleet"], live_filter["control"], live_filter["ca"]
    # The chart's own flags started the real SuperLink on the pod's loopback.
    assert "--host=127.0.0.1" in live_filter["args"] and "--enable-supernode-auth" in live_filter["args"]
    # Through the fleet port the unauthenticated Control API is the filter's 404, never Flower's 200.
    for path in ("/v1/control/list-nodes", "/v1/control/register-node", "/v1/control/start-run", "/docs", "/openapi.json",
                 "/v1/runtime/acquire-task", "/v1/fleet/../control/list-nodes", "/v1/fleet/%2e%2e/control/list-nodes",
                 "/v1/fleet/..%2fcontrol/list-nodes", "/v1/fleet//../control/list-nodes"):
        status, marker, body = _post(fleet, path, ca)
        assert (status, marker) == (404, "refused") and "fedpipe filter" in body, (path, status, body)
    assert _post(fleet, "/v1/fleet/get-run", ca, method="GET")[:2] == (404, "refused")  # POST only
    # A Fleet call reaches Flower: its own answer (an unsigned request to an authenticating SuperLink is refused by
    # Flower, not by the filter), not the filter's marker.
    status, marker, body = _post(fleet, "/v1/fleet/get-run", ca)
    assert marker == "" and "fedpipe filter" not in body and status != 404, (status, body)
    print(f"Flower's own answer to an unsigned POST /v1/fleet/get-run through the fleet port: {status} {body[:200]}")
    assert _post(fleet, "/health", ca, method="GET")[:2] == (200, "")
    # The control port passes the Control API (Flower's 200) to a caller with the token and refuses the Fleet API; the
    # SuperLink itself refuses a Control API call without the token (fedpipe.federation.control: 403, its own marker).
    assert _post(control, "/v1/control/list-nodes", ca, token=live_filter["token"])[:2] == (200, "")
    status, marker, body = _post(control, "/v1/control/list-nodes", ca)
    assert (status, marker) == (403, "") and "needs the operator's token" in body, (status, body)
    status, marker, body = _post(control, "/v1/control/register-node", ca, token="x" * 43)
    assert status == 403 and "needs the operator's token" in body, (status, body)
    status, marker, _ = _post(control, "/v1/fleet/get-run", ca)
    assert (status, marker) == (404, "refused")


@pytest.mark.services
def test_a_real_supernode_registered_through_control_activates_through_fleet(live_filter, tmp_path):
    """`flwr supernode register` through the control port, then `flower-supernode --superlink 127.0.0.1:<fleet port>`:
    the SuperLink lists the node online (activation, heartbeats and long polls passed the filter)."""
    fed = live_filter["fed"]
    site = tmp_path / "site-0"
    site.mkdir()
    fed.start_site(site)
    deadline, nodes = time.monotonic() + 40, []
    while time.monotonic() < deadline:
        r = fed._cli("supernode", "list", "fedpipe-tryout", "--format", "json")
        nodes = json.loads(r.stdout).get("nodes", []) if r.returncode == 0 and r.stdout.strip().startswith("{") else []
        if any(n.get("status") == "online" for n in nodes):
            break
        assert fed.procs["site-0"].poll() is None, fed.log_of("site-0")[-3000:]
        time.sleep(1)
    assert [n["status"] for n in nodes] == ["online"], (nodes, fed.log_of("site-0")[-3000:], fed.log_of("filter")[-3000:])
    access = fed.log_of("filter")
    assert "POST /v1/fleet/activate-node" in access and "POST /v1/control/register-node" in access, access[-3000:]


def test_the_registered_pipeline_submits_to_this_superlink_and_mounts_its_ca(render_chart, tmp_path):
    """With federation.enabled the registration Job's `fedpipe register` gets --federation-superlink (the control
    Service and port) and --federation-ca-secret (the SuperLink's TLS Secret). Compiled with exactly those flags (parsed
    by fedpipe's own CLI), the pipeline's run parameter federation_superlink defaults to the control Service, and the
    census, phase and evaluate tasks (and no simulation task) mount the CA-only Secret (federation.tls.caSecretName) where
    federation.root_certificates points; no task mounts the SuperLink's own TLS Secret, which holds its private key."""
    import yaml
    from typer.testing import CliRunner

    from fedpipe.cli import app
    from fedpipe.pipelines.builder import FEDERATION_CA_DIR, FEDERATION_CONTROL_DIR

    job = only(render_chart(*TLS_SECRET), "Job", "-register")
    (register,) = job["spec"]["template"]["spec"]["containers"]
    chosen = [a for a in register["args"] if a.startswith("--federation-")]
    assert chosen == [f"--federation-superlink={CONTROL}:9091", "--federation-ca-secret=federation-ca",  # the CA alone: no key
                      f"--federation-control-secret={CONTROL}-token"]
    out = tmp_path / "fedavg.yaml"
    result = CliRunner().invoke(app, ["compile", "--set", "method.name=fedavg", "--out", str(out), *chosen])
    assert result.exit_code == 0, result.output
    spec, platform = yaml.safe_load_all(out.read_text())
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["federation_superlink"]["defaultValue"] == f"{CONTROL}:9091"
    assert params["federation_root_certificates"]["defaultValue"] == f"{FEDERATION_CA_DIR}/ca.crt"
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    mounted = sorted(label for label, config in executors.items()
                     if any(v["secretName"] == "federation-ca" and v["mountPath"] == FEDERATION_CA_DIR for v in config.get("secretAsVolume", [])))
    assert mounted == ["exec-federated-census", "exec-federated-evaluate", "exec-federated-phase"]
    # the Control API's token: these three tasks alone (they submit the runs), named to `flwr` by FEDPIPE_CONTROL_TOKEN_FILE
    tokened = sorted(label for label, config in executors.items()
                     if any(v["secretName"] == f"{CONTROL}-token" and v["mountPath"] == FEDERATION_CONTROL_DIR
                            for v in config.get("secretAsVolume", [])))
    assert tokened == mounted
    containers = spec["deploymentSpec"]["executors"]
    for label in tokened:
        env = {e["name"]: e.get("value") for e in containers[label]["container"].get("env", [])}
        assert env["FEDPIPE_CONTROL_TOKEN_FILE"] == f"{FEDERATION_CONTROL_DIR}/token", label
    assert not [label for label, config in executors.items() if any(v["secretName"] == "superlink-tls" for v in config.get("secretAsVolume", []))]
