"""charts/fedpipe-site: one site of a federation (a SuperNode running `fedpipe site join`), rendered by the real
`helm`, validated against Kubernetes 1.30's and 1.34's schemas (kubernetes-validate), its values schema and cross-field checks
failing with a named error, its pods locked down, and its command lines parsed by fedpipe's own CLI (the options a
chart passes are the options `fedpipe site join` and `fedpipe site check` take). The SuperNode joining a real
SuperLink with such a command line is tests/federation/test_own_files.py's `fedpipe site join`."""

from __future__ import annotations

import pytest
import typer
import yaml
from deploytools import K8S_SPAN, REPO, assert_values_documented, parse_docs, run_tool

from fedpipe.cli import app

SITE_CHART = REPO / "charts" / "fedpipe-site"
RELEASE = "hospital-a"
WITHOUT_PEERS = ["--set", "site.name=hospital-a", "--set", "superlink.address=fl.example.org:9092", "--set",
                 "superlink.caSecret.name=federation-ca", "--set", "siteKey.secretName=hospital-a-key"]
REQUIRED = [*WITHOUT_PEERS, "--set", "networkPolicy.superlinkPeers[0].ipBlock.cidr=203.0.113.7/32"]
VOLUME = ["--set", "data.volume.claimName=hospital-a-images", "--set", "data.path=images"]
S3 = ["--set", "data.source=s3", "--set", "data.s3.url=s3://hospital-a/images", "--set", "data.s3.secretName=hospital-a-s3",
      "--set", "data.s3.endpoint=http://minio.hospital-a.svc:9000", "--set", "networkPolicy.s3Peers[0].ipBlock.cidr=10.0.0.0/24",
      "--set", "networkPolicy.s3Port=9000"]
VARIANTS = {
    "volume": VOLUME,
    "hostpath": ["--set", "data.volume.hostPath=/srv/hospital-a"],
    "s3-gpu-optout": [*S3, "--set", "gpu.count=1", "--set", "image.tag=0.1.0-cuda", "--set", "site.optOut=true",
                      "--set", "data.imageSize=28", "--set", "state.existingClaim=hospital-a-state"],
    "no-network-policy": [*VOLUME, "--set", "networkPolicy.enabled=false"],
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def render(helm: str, *args: str, check: bool = True):
    proc = run_tool([helm, "template", RELEASE, str(SITE_CHART), "--namespace", "site-a", *args], check=check)
    return parse_docs(proc.stdout) if check else proc


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in docs}


def test_helm_lint_is_clean(helm):
    proc = run_tool([helm, "lint", "--strict", str(SITE_CHART), *REQUIRED, *VOLUME])
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_validates_against_kubernetes(helm, validate_k8s, variant):
    docs = render(helm, *REQUIRED, *VARIANTS[variant])
    hook = [d for d in docs if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    assert len(hook) == 1 and hook[0]["kind"] == "Pod"
    validate_k8s(docs, K8S_SPAN)


@pytest.mark.parametrize("values, named", [
    ({"superlink": {"address": "fl.example.org"}}, "superlink.address"),
    ({"site": {"name": "hospital a"}}, "site.name"),
    ({"data": {"source": "nfs"}}, "data.source"),
    ({"gpu": {"count": -1}}, "gpu.count"),
    ({"data": {"path": "../other-site"}}, "data.path"),
    ({"data": {"s3": {"url": "http://bucket/prefix"}}}, "data.s3.url"),
    ({"data": {"s3": {"endpoint": "http://user:pw@minio:9000"}}}, "data.s3.endpoint"),
    ({"image": {"digest": "latest"}}, "image.digest"),
    ({"unknownValue": 1}, "unknownValue"),
])  # fmt: skip
def test_the_schema_names_a_wrong_value(helm, tmp_path, values, named):
    good = {"site": {"name": "hospital-a"}, "superlink": {"address": "fl.example.org:9092", "caSecret": {"name": "federation-ca"}},
            "siteKey": {"secretName": "hospital-a-key"}, "data": {"volume": {"claimName": "images"}},
            "networkPolicy": {"superlinkPeers": [{"ipBlock": {"cidr": "203.0.113.7/32"}}]}}
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(good))
    assert render(helm, "-f", str(path))  # the good values render
    path.write_text(yaml.safe_dump(_merge(good, values)))
    proc = render(helm, "-f", str(path), check=False)
    assert proc.returncode != 0 and "schema" in proc.stderr, proc.stderr
    assert named.split(".")[-1] in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    ([], "data.volume: name exactly one of"),
    ([*VOLUME, "--set", "data.volume.hostPath=/srv/a"], "data.volume: name exactly one of"),
    (["--set", "data.source=s3", "--set", "data.s3.secretName=s"], "data.s3.url: data.source=s3 needs"),
    (["--set", "data.source=s3", "--set", "data.s3.url=s3://bucket/a"], "data.s3.secretName: data.source=s3 needs"),
    (["--set", "data.source=s3", "--set", "data.s3.url=s3://bucket/a", "--set", "data.s3.secretName=s"], "networkPolicy.s3Peers"),
])  # fmt: skip
def test_values_that_only_work_together_fail_with_a_message(helm, args, message):
    proc = render(helm, *REQUIRED, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_the_network_policy_needs_the_superlinks_place(helm):
    proc = render(helm, *WITHOUT_PEERS, *VOLUME, check=False)
    assert proc.returncode != 0 and "networkPolicy.superlinkPeers" in proc.stderr, proc.stderr


def _pods(docs: list[dict]) -> list[tuple[str, dict]]:
    kinds = by_kind(docs)
    return [("supernode", kinds["Deployment"]["spec"]["template"]["spec"]), ("check", kinds["Pod"]["spec"])]


@pytest.mark.parametrize("variant", ["volume", "s3-gpu-optout"])
def test_the_pods_are_locked_down(helm, variant):
    """Non-root with seccomp, read-only root, no capabilities, no service account token, requests and limits, /tmp an
    emptyDir; the key readable by the pod's group only; the data volume mounted read-only."""
    for name, pod in _pods(render(helm, *REQUIRED, *VARIANTS[variant])):
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert "emptyDir" in volumes["tmp"] and mounts["tmp"]["mountPath"] == "/tmp"
        assert volumes["site-key"]["secret"]["defaultMode"] == 0o440 and mounts["site-key"]["readOnly"]
        if "data" in volumes:
            assert volumes["data"]["persistentVolumeClaim"]["readOnly"] and mounts["data"]["readOnly"]
        env = {e["name"]: e for e in container["env"]}
        assert env["FLWR_HOME"]["value"].startswith("/tmp/")
        if variant.startswith("s3"):
            assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "hospital-a-s3"


def test_a_gpu_is_a_limit_and_state_an_existing_claim(helm):
    docs = render(helm, *REQUIRED, *VARIANTS["s3-gpu-optout"])
    pod = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {v["name"]: v for v in pod["volumes"]}["state"]["persistentVolumeClaim"]["claimName"] == "hospital-a-state"
    assert "PersistentVolumeClaim" not in by_kind(docs)  # the existing one is used
    own = by_kind(render(helm, *REQUIRED, *VOLUME))["PersistentVolumeClaim"]
    assert own["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # personal models survive an uninstall


def test_the_check_pod_lands_where_the_site_pod_does(helm, tmp_path):
    """A hostPath site pinned to its node by affinity: `helm test`'s pod must go to that node too, or it finds no files."""
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}]}]}}}
    placement = {"affinity": affinity, "nodeSelector": {"disk": "ssd"},
                 "tolerations": [{"key": "site", "operator": "Equal", "value": "a", "effect": "NoSchedule"}]}
    path = tmp_path / "placement.yaml"
    path.write_text(yaml.safe_dump(placement))
    pods = dict(_pods(render(helm, *REQUIRED, *VARIANTS["hostpath"], "-f", str(path))))
    for key, value in placement.items():
        assert pods["check"][key] == pods["supernode"][key] == value, key


def _parse(command: list[str]) -> dict:
    """The options fedpipe's own CLI reads from a rendered command line (`fedpipe site join|check ...`)."""
    assert command[:2] == ["fedpipe", "site"], command
    group = typer.main.get_command(app)
    site = group.get_command(None, "site")
    sub = site.get_command(None, command[2])
    assert sub is not None, f"fedpipe site has no command {command[2]!r}"
    return sub.make_context(command[2], list(command[3:])).params


def test_the_command_lines_are_fedpipes_own(helm):
    """What the pods run parses with `fedpipe site join` / `fedpipe site check` (an option the CLI does not have would
    fail here, not in a cluster), pointing at the mounted paths and the site's own data only."""
    pods = dict(_pods(render(helm, *REQUIRED, *VOLUME)))
    join = _parse(pods["supernode"]["containers"][0]["command"])
    assert join["data"] == "/data/images" and join["superlink"] == "fl.example.org:9092" and str(join["state"]) == "/state"
    assert str(join["root_certificates"]) == "/etc/fedpipe/ca/ca.crt" and str(join["key"]) == "/etc/fedpipe/key/site.key"
    assert join["opt_out"] is False
    check = _parse(pods["check"]["containers"][0]["command"])
    assert {k: str(check[k]) for k in ("data", "superlink", "key")} == {k: str(join[k]) for k in ("data", "superlink", "key")}
    s3 = dict(_pods(render(helm, *REQUIRED, *VARIANTS["s3-gpu-optout"])))
    join = _parse(s3["supernode"]["containers"][0]["command"])
    assert join["data"] == "s3://hospital-a/images" and join["opt_out"] is True and join["image_size"] == 28


def test_the_network_policy_admits_nothing_in_and_only_the_federation_out(helm):
    policy = by_kind(render(helm, *REQUIRED, *VARIANTS["s3-gpu-optout"]))["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["ingress"] == []
    egress = [(rule["to"], [p["port"] for p in rule["ports"]]) for rule in policy["egress"]]
    assert egress[1] == ([{"ipBlock": {"cidr": "203.0.113.7/32"}}], [9092])  # the port from superlink.address
    assert egress[2] == ([{"ipBlock": {"cidr": "10.0.0.0/24"}}], [9000])
    assert egress[0][1] == [53, 53] and len(egress) == 3
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "fedpipe-site", "app.kubernetes.io/instance": RELEASE}
    no_s3 = by_kind(render(helm, *REQUIRED, *VOLUME))["NetworkPolicy"]["spec"]["egress"]
    assert len(no_s3) == 2


def test_notes_say_what_to_do_next(helm):
    proc = run_tool([helm, "install", RELEASE, str(SITE_CHART), "--dry-run=client", *REQUIRED, *VOLUME])
    assert "flwr supernode register hospital-a.pub" in proc.stdout and f"helm test {RELEASE}" in proc.stdout


def test_every_value_is_commented_typed_and_in_the_readme():
    assert_values_documented(SITE_CHART, {"commonLabels", "resources", "podSecurityContext", "containerSecurityContext",
                                          "tests.resources", "nodeSelector", "affinity"})


def test_the_sites_policy_reaches_both_pods_as_a_file_fedpipe_validates(helm, tmp_path):
    """`site.policy` becomes a ConfigMap mounted read-only into the site's pod and its helm test pod, and both command
    lines point `--policy` at it; the rendered file parses as the policy fedpipe runs (a wrong key would stop the site)."""
    from fedpipe.federation.policy import SitePolicy

    policy = {"methods": ["fedavg"], "privacy": {"required": True, "mode": "local", "max_epsilon": 8.0},
              "release": {"label_counts": False}, "federations": [{"superlink": "fl.example.org:9092", "run_prefix": "cardio-"}]}
    docs = render(helm, *REQUIRED, *VOLUME, "--set-json", f"site.policy={__import__('json').dumps(policy)}")
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policy")]
    (tmp_path / "policy.yaml").write_text(config_map["data"]["policy.yaml"])
    rules = SitePolicy.read(tmp_path / "policy.yaml")
    assert rules.methods == ("fedavg",) and rules.privacy.max_epsilon == 8.0 and not rules.release.label_counts
    assert rules.serves("fl.example.org:9092") is None
    for _, pod in _pods(docs):
        (container,) = pod["containers"]
        assert str(_parse(container["command"])["policy"]) == "/etc/fedpipe/policy/policy.yaml"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "policy")
        assert mount["mountPath"] == "/etc/fedpipe/policy" and mount["readOnly"] is True
        assert next(v for v in pod["volumes"] if v["name"] == "policy")["configMap"]["name"] == config_map["metadata"]["name"]
    empty = render(helm, *REQUIRED, *VOLUME)
    (default,) = [d for d in empty if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policy")]
    (tmp_path / "default.yaml").write_text(default["data"]["policy.yaml"])
    assert SitePolicy.read(tmp_path / "default.yaml") == SitePolicy()
