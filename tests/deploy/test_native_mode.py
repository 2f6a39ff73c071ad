"""The chart's KFP Kubernetes-native API mode (`nativeMode.enabled`): the pipeline as `Pipeline` and
`PipelineVersion` resources, from the precompiled copies in charts/fedpipe/files/pipelines/.

Upstream behaviour encoded here is KFP 2.16.0's (Kubeflow 26.03), read in kubeflow/pipelines at tag 2.16.0;
the native pipeline store first shipped in 2.14.0 (`c03127d`, #11881, with the platform spec field from
#12016); 2.5.0 had the CRDs and the webhook but no store. The CRDs are tests/deploy/schemas/
pipelines.kubeflow.org_*.v2beta1.yaml (see the README there), identical at 2.14.0 and 2.16.0.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re

import deploytools
import pytest
import yaml
from deploytools import CHART, CLUSTER, NAMESPACE, RELEASE, REPO, _closed, import_tool, only, run_tool
from kfp_backend import flat_tasks

from fedpipe.algorithms import ALGORITHMS
from fedpipe.pipelines.builder import DeployOptions

SCHEMAS = REPO / "tests" / "deploy" / "schemas"
FILES = CHART / "files" / "pipelines"
PIPELINES = REPO / "pipelines"  # the compiled pipelines `fedpipe compile --all` ships
NATIVE = ["--set", "nativeMode.enabled=true", "--set", "register.enabled=false", "--set", "signing.enabled=false"]  # it cannot sign yet
GROUP_VERSION = "pipelines.kubeflow.org/v2beta1"
EXTERNAL_PUSHGATEWAY = "http://prometheus-pushgateway.monitoring:9091"
CHART_PUSHGATEWAY = f"http://{RELEASE}-pushgateway.{NAMESPACE}:9091"

# A deployment that changes every value native mode applies (images, GPU, resources, storage, Secret and its
# keys, Pushgateway, namespace, name) and run-config fields of each kind (parameters of each type, a list
# with no parameter, a local store that gives way to the deployment's).
CHANGED = [
    "--set", "image.repository=registry.example.com/ml/fedpipe", "--set", "image.tag=1.2.3",
    "--set", "image.trainingTag=1.2.3-cuda12", "--set", "training.acceleratorCount=0",
    "--set", "training.acceleratorType=amd.com/gpu", "--set", "training.resources.limits.memory=64Gi",
    "--set", "steps.resources.requests.cpu=250m", "--set", "storage.accessKeyKey=access",
    "--set", "storage.secretKeyKey=secret", "--set", "pushgateway.enabled=false",
    "--set", "prometheusScrapeConfig.enabled=false", "--set", f"pushgateway.url={EXTERNAL_PUSHGATEWAY}",
    "--set", "kubeflow.namespace=kubeflow-user-example-com", "--set", "pipeline.name=mnist-retrain",
]  # fmt: skip
# Where the artifact store and its credentials are (the registration Job passes them as env vars).
STORAGE_LOCATION = ["--set", "storage.endpoint=http://s3.example.com:9000", "--set", "storage.existingSecret=team-s3"]
CHANGED_CONFIG = {
    "run": {"store": "/tmp/local-runs", "seed": 7},
    "train": {"rounds": 5, "lr": 0.05},
    "partition": {"num_clients": 10, "feature_shift": ["rotate90", "flip"]},
    "telemetry": {"progress": True},
}


# --- what the chart embeds ------------------------------------------------------------------------------


def load_script():
    spec = importlib.util.spec_from_file_location("chart_pipelines", REPO / "scripts" / "chart_pipelines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def fresh() -> dict[str, dict]:
    """Each method's pipeline as the builder compiles it now with the release defaults, as the two fields of a
    PipelineVersion: {method: {"pipelineSpec": ..., "platformSpec": ...}}. Read from pipelines/<method>.yaml, which
    tests/test_pipelines.py::test_shipped_pipelines_and_components_are_up_to_date compiles afresh
    (`shipped_pipelines()`, the same DeployOptions()) and compares byte for byte: the two tests together chain the
    chart's copies to the builder without compiling every pipeline twice."""
    out = {}
    for method in ALGORITHMS:
        docs = [d for d in yaml.safe_load_all((PIPELINES / f"{method}.yaml").read_text()) if d]
        out[method] = {"pipelineSpec": docs[0], "platformSpec": docs[1] if len(docs) > 1 else None}
    return out


def test_chart_copies_are_a_fresh_compile(fresh):
    """The chart's copies are the builder's pipelines as compiled now, in the script's exact format, and
    nothing else: a change to the builder without `scripts/chart_pipelines.py` fails here."""
    stale = "charts/fedpipe/files/pipelines/ is stale: run .venv/bin/python scripts/chart_pipelines.py and commit the result"
    shipped = {p.stem for p in FILES.glob("*.json")} - {"index"}
    assert shipped == set(ALGORITHMS), f"{stale} (methods {sorted(shipped ^ set(ALGORITHMS))})"
    dump = load_script()._dump
    for method, version in fresh.items():
        text = (FILES / f"{method}.json").read_text()
        diff = _differences(json.loads(text), version)
        assert not diff, f"{stale} ({method}.json differs from a fresh compile at:\n" + "\n".join(diff[:10]) + ")"
        assert text == dump(version), f"{stale} ({method}.json is not in the script's format)"


def test_index_says_what_the_copies_were_compiled_with(fresh):
    index = json.loads((FILES / "index.json").read_text())
    release = DeployOptions()
    assert index["compiledWith"] == {
        "image": release.image, "trainingImage": release.training_image, "store": release.store,
        "s3Endpoint": release.s3_endpoint, "s3Secret": release.s3_secret, "s3SecretKeys": list(release.s3_secret_keys),
        "pushgateway": release.pushgateway,
    }  # fmt: skip
    for method, version in fresh.items():
        spec = version["pipelineSpec"]
        params = spec["root"]["inputDefinitions"]["parameters"]
        for path in index["pipelines"][method]["fieldDefaults"]:
            node = spec
            for step in path:
                node = node[step]
            assert node == {k: params[k.replace(".", "_")]["defaultValue"] for k in node}, (
                f"{method}: {path} is not a copy of the defaults"
            )


# --- rendering --------------------------------------------------------------------------------------------


def native(render_chart, *args: str) -> list[dict]:
    return render_chart(*NATIVE, *args)


def version_of(docs: list[dict]) -> dict:
    (version,) = [d for d in docs if d["kind"] == "PipelineVersion"]
    return version


def changed_render(render_chart, tmp_path, *extra: str) -> list[dict]:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"runConfig": CHANGED_CONFIG}))
    return native(render_chart, *CHANGED, *STORAGE_LOCATION, "-f", str(values), *extra)


def test_native_mode_renders_a_pipeline_and_its_version_and_no_job(render_chart):
    docs = native(render_chart)
    kinds = {f"{d['kind']}/{d['metadata']['name']}" for d in docs}
    assert {"Job/fedpipe-register", "Role/fedpipe-register", "ConfigMap/fedpipe-run-config"}.isdisjoint(kinds), kinds
    pipeline = only(docs, "Pipeline")
    version = version_of(docs)
    assert pipeline["apiVersion"] == version["apiVersion"] == GROUP_VERSION
    assert pipeline["metadata"]["name"] == version["spec"]["pipelineName"] == "fedpipe-superfed-mm"
    # The UI lists the display name, else the name (backend/src/crd/kubernetes/v2beta1/pipeline_types.go, ToModel).
    assert pipeline["spec"]["displayName"] == "fedpipe-superfed-mm"
    assert version["metadata"]["namespace"] == pipeline["metadata"]["namespace"] == NAMESPACE
    assert version["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "annotations" not in version_of(native(render_chart, "--set", "nativeMode.keepOldVersions=false"))["metadata"]
    assert not [d for d in render_chart() if d["kind"] in ("Pipeline", "PipelineVersion")], "native mode is off by default"


def test_pipeline_is_created_before_its_version(render_chart):
    """The mutating webhook looks the Pipeline up (pipelineversion_webhook.go, Default), so it must exist
    first. `helm template` prints in Helm's install order, which puts unknown kinds last, alphabetically
    (helm/helm pkg/release/util/kind_sorter.go, lessByKind), and Helm creates one kind after the other,
    waiting for each (helm/helm pkg/kube/client.go, batchPerform)."""
    kinds = [d["kind"] for d in native(render_chart) if d["kind"].startswith("Pipeline")]
    assert kinds == ["Pipeline", "PipelineVersion"]


# --- the API server: CRD schemas, webhooks, run creation ---------------------------------------------------

# KFP 2.16.0 backend/src/apiserver/common/utils.go, pipelineNamePattern (ValidatePipelineName).
PIPELINE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,127}$")
# backend/src/apiserver/template/v2_template.go, NewV2SpecTemplate: MatchString without anchors, so any name
# with one lower-case letter or digit passes it (ValidatePipelineName above is the real rule).
SPEC_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Custom resources' names (kubernetes staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/
# validator.go, customResourceValidator.Validate: NameIsDNSSubdomain).
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# JSON names of proto fields added after 2.16.0 (git diff 2.16.0 2.17.0 -- api/v2alpha1/pipeline_spec.proto
# kubernetes_platform/proto/kubernetes_executor_config.proto): the installed kfp-pipeline-spec and
# kfp-kubernetes (2.17) parse them, a 2.16.0 server's protojson.Unmarshal refuses them.
AFTER_2_16 = {"resourceTtlOnCompletion", "resourceTtlOnSuccess", "resourceTtlOnFailure", "activeDeadlineSeconds", "dataSource"}


def crd_problems(doc: dict) -> list[str]:
    """The CRD's openAPIV3Schema, closed (an unknown field is pruned silently by the API server: an
    error here; see deploytools._closed), plus the name rule of every custom resource."""
    jsonschema = import_tool("jsonschema", "jsonschema")
    plural = {"Pipeline": "pipelines", "PipelineVersion": "pipelineversions"}[doc["kind"]]
    crd = yaml.safe_load((SCHEMAS / f"pipelines.kubeflow.org_{plural}.v2beta1.yaml").read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == doc["apiVersion"].split("/")[1]]
    schema = _closed(served["schema"]["openAPIV3Schema"])
    problems = [
        f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]
    if doc["apiVersion"] != f"{crd['spec']['group']}/{served['name']}":
        problems.append(f"apiVersion {doc['apiVersion']} is not {crd['spec']['group']}/{served['name']}")
    name = doc["metadata"].get("name", "")
    if not (DNS_SUBDOMAIN.match(name) and len(name) <= 253):
        problems.append(f"metadata.name {name!r} is not a DNS subdomain")
    return problems


def _parses(message, value) -> str | None:
    """protojson.Unmarshal's verdict (unknown fields refused), through the Python protobuf runtime."""
    from google.protobuf import json_format

    try:
        json_format.ParseDict(value, message)
    except json_format.ParseError as e:
        return str(e)
    return None


def v2_spec_problems(version: dict) -> list[str]:
    """KFP 2.16.0 PipelineVersion.ToModel (backend/src/crd/kubernetes/v2beta1/pipelineversion_types.go)
    joins spec.pipelineSpec and spec.platformSpec as two YAML documents, which
    template.NewV2SpecTemplate (backend/src/apiserver/template/v2_template.go) reads: a document is the
    pipeline spec if it parses as a PipelineSpec with a name and a root (isPipelineSpec), else the platform
    spec if it parses as a PlatformSpec with a `kubernetes` platform (IsPlatformSpecWithKubernetesConfig),
    else it is DROPPED without a word."""
    from kfp.pipeline_spec import pipeline_spec_pb2

    spec = version["spec"]
    docs = [("pipelineSpec", spec.get("pipelineSpec"))]
    if spec.get("platformSpec") is not None:
        docs.append(("platformSpec", spec["platformSpec"]))
    problems, pipeline = [], None
    for field, doc in docs:
        parsed = pipeline_spec_pb2.PipelineSpec()
        if isinstance(doc, dict) and _parses(parsed, doc) is None and parsed.pipeline_info.name and parsed.HasField("root"):
            if pipeline is not None:
                problems.append("multiple pipeline specs provided")
            pipeline = parsed
            if parsed.schema_version != "2.1.0":
                problems.append(
                    f"KFP only supports schema version 2.1.0, but the pipeline spec has version {parsed.schema_version}"
                )
            if not SPEC_NAME.search(parsed.pipeline_info.name):
                problems.append("invalid v2 pipeline spec: name should consist of lower case alphanumeric characters")
            continue
        platform = pipeline_spec_pb2.PlatformSpec()
        if isinstance(doc, dict) and _parses(platform, doc) is None and "kubernetes" in platform.platforms:
            continue
        problems.append(
            f"spec.{field} is neither a pipeline spec nor a Kubernetes platform spec: KFP would drop it"
            f" ({_parses(pipeline_spec_pb2.PipelineSpec(), doc) if field == 'pipelineSpec' else _parses(platform, doc)})"
        )
    if pipeline is None:
        problems.append("no pipeline spec is provided")
    elif not PIPELINE_NAME.match(pipeline.pipeline_info.name):
        # ValidateCreate then calls common.ValidatePipelineName on pipelineInfo.name.
        problems.append(
            "pipeline's name must contain only lowercase alphanumeric characters or '-' and must start with alphanumeric characters"
        )
    return problems


def webhook_problems(version: dict, docs: list[dict]) -> list[str]:
    """What KFP 2.16.0's PipelineVersion webhooks (backend/src/apiserver/webhook/pipelineversion_webhook.go)
    refuse on create: Default (mutating) fails unless spec.pipelineName names a Pipeline in the version's
    namespace (getPipeline), and copies that name, cut to 63 characters, into a label value; ValidateCreate
    needs ToModel and NewV2SpecTemplate to accept the spec (v2_spec_problems) and ValidatePipelineName."""
    problems = []
    name, namespace = version["spec"].get("pipelineName", ""), version["metadata"].get("namespace")
    owners = [
        d
        for d in docs
        if d["kind"] == "Pipeline" and d["metadata"]["name"] == name and d["metadata"].get("namespace") == namespace
    ]
    if not owners:
        problems.append("The spec.pipelineName doesn't map to an existing Pipeline object")
    if not re.match(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$", name[:63]):
        problems.append(f"the label pipelines.kubeflow.org/pipeline={name[:63]!r} the webhook sets is not a label value")
    return problems + v2_spec_problems(version)


def run_creation_problems(version: dict) -> list[str]:
    """What creating a run refuses later: argocompiler (backend/src/v2/compiler/argocompiler/container.go,
    containerExecutorTask) unmarshals each executor's Kubernetes config with protojson, unknown fields refused;
    fields newer than the 2.16.0 protos are refused there too (AFTER_2_16)."""
    from kfp.kubernetes import kubernetes_executor_config_pb2

    problems = []
    platform = version["spec"].get("platformSpec") or {}
    for label, config in (
        platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {}).items()
    ):
        error = _parses(kubernetes_executor_config_pb2.KubernetesExecutorConfig(), config)
        if error:
            problems.append(f"{label}: failed to unmarshal kubernetes config: {error}")
    newer = sorted(AFTER_2_16 & set(re.findall(r'"(\w+)":', json.dumps(version["spec"]))))
    if newer:
        problems.append(f"fields a 2.16.0 server does not know: {newer}")
    return problems


def validate_native(doc: dict, docs: list[dict] | None = None) -> None:
    problems = crd_problems(doc)
    if doc["kind"] == "PipelineVersion":
        problems += webhook_problems(doc, docs or []) + run_creation_problems(doc)
    assert not problems, f"the {doc['kind']} would be refused:\n" + "\n".join(problems)


@pytest.mark.parametrize("method", ["superfed_mm", "fedavg", "fedmoe"])
def test_rendered_resources_pass_the_crds_and_the_webhooks(render_chart, validate_k8s, monkeypatch, method, tmp_path):
    for docs in (
        native(render_chart, "--set", f"pipeline.method={method}"),
        changed_render(render_chart, tmp_path, "--set", f"pipeline.method={method}"),
    ):
        for doc in docs:
            if doc["kind"] in ("Pipeline", "PipelineVersion"):
                validate_native(doc, docs)
        # kubernetes-validate has no schema for the two kinds; these validators take them (and the rest of the
        # render goes through it as in test_helm_chart.py).
        monkeypatch.setitem(deploytools.CRD_VALIDATORS, "Pipeline", validate_native)
        monkeypatch.setitem(deploytools.CRD_VALIDATORS, "PipelineVersion", lambda doc, docs=docs: validate_native(doc, docs))
        validate_k8s(docs)


def _mutations():
    def set_in(*path_value):
        *path, value = path_value

        def apply(version, docs):
            node = version
            for step in path[:-1]:
                node = node[step]
            node[path[-1]] = value

        return apply

    return {
        "unknown pipeline": (set_in("spec", "pipelineName", "no-such-pipeline"), "doesn't map to an existing Pipeline"),
        "schema version": (set_in("spec", "pipelineSpec", "schemaVersion", "2.0.0"), "schema version 2.1.0"),
        "unknown spec field": (set_in("spec", "pipelineSpec", "pipelineInfoo", {}), "no pipeline spec is provided"),
        "spec name": (set_in("spec", "pipelineSpec", "pipelineInfo", "name", "Fedpipe_MM"), "pipeline's name must contain only"),
        "no kubernetes platform": (set_in("spec", "platformSpec", {"platforms": {"other": {}}}), "KFP would drop it"),
        "executor field": (lambda v, d: v["spec"]["platformSpec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-evaluate"]
                           .update(secretAsEnvv=[]), "failed to unmarshal kubernetes config"),
        "newer field": (lambda v, d: v["spec"]["platformSpec"]["platforms"]["kubernetes"].update(pipelineConfig={"resourceTtlOnSuccess": 60}),
                        "does not know"),
        "crd field": (set_in("spec", "pipelineSpecUri", "s3://x"), "Additional properties"),
        "name": (set_in("metadata", "name", "Bad_Name"), "DNS subdomain"),
    }  # fmt: skip


@pytest.mark.parametrize("mutation", list(_mutations()))
def test_the_checkers_refuse_what_kfp_refuses(render_chart, mutation):
    """Each rule of validate_native catches its own breakage (so a passing render means something)."""
    docs = native(render_chart)
    version = copy.deepcopy(version_of(docs))
    apply, message = _mutations()[mutation]
    apply(version, docs)
    with pytest.raises(AssertionError, match=re.escape(message)):
        validate_native(version, docs)


def test_an_upgrade_never_changes_a_version_in_place(render_chart, tmp_path):
    """2.16.0's ValidateUpdate refuses any update that bumps metadata.generation, i.e. any spec change
    (pipelineversion_webhook.go; 2.17.0 lets displayName and tags change). So two renders that name the
    same PipelineVersion must give it the same spec, and the same values the same name (a no-op upgrade
    adds no version)."""
    variants = [
        [],
        ["--set", "image.tag=9.9.9"],
        ["--set", "training.acceleratorCount=2"],
        ["--set", "runConfig.train.rounds=3"],
        ["--set", "storage.endpoint=http://s3.example.com:9000"],
        ["--set", "nativeMode.keepOldVersions=false"],
        ["--set", "pipeline.method=fedavg"],
        ["--set", "pipeline.name=other"],
        ["--set", "storage.existingSecret=team-s3"],
    ]  # the platform spec alone
    seen: dict[str, dict] = {}
    for variant in variants:
        version = version_of(native(render_chart, *variant))
        previous = seen.setdefault(version["metadata"]["name"], version["spec"])
        assert previous == version["spec"], f"{variant} changes the spec of {version['metadata']['name']} in place"
    assert len(set(seen)) == len(variants) - 1, "every variant but keepOldVersions changes the pipeline, so its version"
    assert version_of(native(render_chart))["metadata"]["name"] in seen


# --- the spec: the compiled pipeline with the values applied ------------------------------------------------


def _base_parsed(spec: dict) -> dict:
    """The spec with base_config's JSON default parsed (the chart writes it with sorted keys, json.dumps in
    field order: the same config)."""
    spec = copy.deepcopy(spec)
    base = spec["root"]["inputDefinitions"]["parameters"]["base_config"]
    base["defaultValue"] = json.loads(base["defaultValue"])
    return spec


def _differences(a, b, path=()) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(set(a) | set(b), key=str)
            for d in _differences(a.get(k, "<absent>"), b.get(k, "<absent>"), (*path, k))
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, (*path, i))]
    same = (
        type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b
    )  # True == 1 in Python, not in JSON
    return [] if same else [f"{'.'.join(map(str, path))}: {a!r} != {b!r}"]


def expected_version(
    fresh: dict, method: str, *, images: dict, endpoint: str, secret: str, keys: tuple[str, str], defaults: dict, config: dict
) -> dict:
    """The compiled pipeline with a deployment applied, written from what DeployOptions and the run config
    mean (pipelines/builder.py), not from the template: images by the one each task was compiled with,
    FEDPIPE_S3_ENDPOINT, the credentials Secret (both its name fields) and keys, parameter defaults, and
    the config (`section.key` values) in base_config and in the config task's copy of the defaults."""
    version = copy.deepcopy(fresh[method])
    spec = version["pipelineSpec"]
    for executor in spec["deploymentSpec"]["executors"].values():
        container = executor["container"]
        container["image"] = images[container["image"]]
        for env in container.get("env", []):
            if env["name"] == "FEDPIPE_S3_ENDPOINT":
                env["value"] = endpoint
    for executor in version["platformSpec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        for source in executor.get("secretAsEnv", []):
            source["secretName"] = secret
            source["secretNameParameter"]["runtimeValue"]["constant"] = secret
            for pair in source["keyToEnv"]:
                pair["secretKey"] = {"AWS_ACCESS_KEY_ID": keys[0], "AWS_SECRET_ACCESS_KEY": keys[1]}[pair["envVar"]]
    params = spec["root"]["inputDefinitions"]["parameters"]
    base = json.loads(params["base_config"]["defaultValue"])
    for field, value in config.items():
        section, key = field.split(".")
        base[section][key] = value
        if field.replace(".", "_") in params:
            params[field.replace(".", "_")]["defaultValue"] = value
    for name, value in defaults.items():
        params[name]["defaultValue"] = value
    params["base_config"]["defaultValue"] = json.dumps(base)
    for path in json.loads((FILES / "index.json").read_text())["pipelines"][method]["fieldDefaults"]:
        node = spec
        for step in path:
            node = node[step]
        node.update({k: v for k, v in config.items() if k in node})
    return version


def assert_same_version(rendered: dict, expected: dict) -> None:
    for field in ("pipelineSpec", "platformSpec"):
        diff = _differences(
            _base_parsed(rendered[field]) if field == "pipelineSpec" else rendered[field],
            _base_parsed(expected[field]) if field == "pipelineSpec" else expected[field],
        )
        assert not diff, f"spec.{field} differs from the compiled pipeline with the values applied:\n" + "\n".join(diff[:40])


def test_default_values_change_only_the_pushgateway_and_the_chart_s_run_config(render_chart, fresh):
    rendered = version_of(native(render_chart))["spec"]
    release = DeployOptions()
    expected = expected_version(
        fresh, "superfed_mm", images={release.image: release.image, release.training_image: release.training_image},
        endpoint=release.s3_endpoint, secret=release.s3_secret, keys=release.s3_secret_keys, defaults={},
        # values.yaml's runConfig (telemetry.progress: false), and the chart's own Pushgateway (builder._deployed)
        config={"run.store": "s3://mlpipeline/fedpipe", "data.dataset": "mnist5k", "telemetry.progress": False,
                "telemetry.pushgateway": CHART_PUSHGATEWAY},
    )  # fmt: skip
    assert_same_version(rendered, expected)


def test_changed_values_land_in_the_spec_and_nothing_else_changes(render_chart, fresh, tmp_path):
    rendered = version_of(changed_render(render_chart, tmp_path))["spec"]
    release = DeployOptions()
    expected = expected_version(
        fresh, "superfed_mm",
        images={release.image: "registry.example.com/ml/fedpipe:1.2.3", release.training_image: "registry.example.com/ml/fedpipe:1.2.3-cuda12"},
        endpoint="http://s3.example.com:9000", secret="team-s3", keys=("access", "secret"),
        defaults={"accelerator_count": "0", "accelerator_type": "amd.com/gpu", "memory_limit": "64Gi", "step_cpu_request": "250m"},
        config={"run.store": release.store, "run.seed": 7, "train.rounds": 5, "train.lr": 0.05,
                "partition.num_clients": 10, "partition.feature_shift": ["rotate90", "flip"], "telemetry.progress": True, "data.dataset": "mnist5k",
                "telemetry.pushgateway": EXTERNAL_PUSHGATEWAY},
    )  # fmt: skip
    assert_same_version(rendered, expected)


def _job_compile(render_chart, tmp_path, values: list[str]) -> dict:
    """What the registration Job would register with the same values: `fedpipe compile` with the Job's
    deployment flags, env vars and run-config ConfigMap (the Job runs `fedpipe register`, which compiles
    through the same `_cluster_pipeline`)."""
    from typer.testing import CliRunner

    from fedpipe.cli import app

    docs = render_chart(*values)
    job = only(docs, "Job", "-register")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    config = tmp_path / "job-config.yaml"
    config.write_text(only(docs, "ConfigMap", "-run-config")["data"]["config.yaml"])
    args = container["args"][1:]
    method = next(a.split("=", 1)[1] for a in args if a.startswith("--method="))
    deploy = [a for a in args if not a.startswith(("--host=", "--method=", "--name=", "--namespace=", "--config="))]
    # The Job's FEDPIPE_S3_* env vars, and nothing from this machine's environment (DeployOptions.from_env).
    env = {
        "FEDPIPE_STORE": None,
        "FEDPIPE_PUSHGATEWAY": None,
        "FEDPIPE_S3_ENDPOINT": None,
        "FEDPIPE_S3_SECRET": None,
        "FEDPIPE_S3_SECRET_KEYS": None,
        **{e["name"]: e["value"] for e in container["env"] if e["name"].startswith("FEDPIPE_")},
    }
    out = tmp_path / "job.yaml"
    result = CliRunner().invoke(
        app, ["compile", "--config", str(config), "--set", f"method.name={method}", *deploy, "-o", str(out)], env=env
    )
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    return {"pipelineSpec": docs[0], "platformSpec": docs[1]}


@pytest.mark.parametrize(
    "scenario", ["default", "changed", "fedavg-cpu", "storage-location"]
)
def test_native_mode_embeds_what_the_registration_job_would_register(render_chart, tmp_path, scenario):
    """The same values, registered by the Job (nativeMode off) or embedded (nativeMode on), give the same
    pipeline: every place the deployment reaches in a fresh `fedpipe compile` is one the template sets."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"runConfig": CHANGED_CONFIG}))
    args = {
        "default": [],
        "changed": [*CHANGED, "-f", str(values)],
        "storage-location": STORAGE_LOCATION,
        "fedavg-cpu": [
            "--set",
            "pipeline.method=fedavg",
            "--set",
            "training.acceleratorCount=0",
            "--set",
            "runConfig.train.rounds=3",
        ],
    }[scenario]
    job = _job_compile(render_chart, tmp_path, [*args, "--set", "signing.enabled=false"])  # native mode cannot sign yet
    rendered = version_of(native(render_chart, *args))["spec"]
    assert_same_version(rendered, job)


# --- where the driver reads them ---------------------------------------------------------------------------

PLACEHOLDER = re.compile(r"^\{\{\$\.inputs\.parameters\['(pipelinechannel--[\w]+)'\]\}\}$")
RESOURCE_FIELDS = {
    "resourceCpuLimit": "cpu_limit",
    "resourceCpuRequest": "cpu_request",
    "resourceMemoryLimit": "memory_limit",
    "resourceMemoryRequest": "memory_request",
}


def test_values_land_where_the_driver_reads_them(render_chart, tmp_path):
    """Followed as KFP 2.16.0 follows it: argocompiler.Compile fills a run's missing parameters from
    root.inputDefinitions (backend/src/v2/compiler/argocompiler/argo.go, Compile); the driver resolves a
    task's resource placeholders `{{$.inputs.parameters['pipelinechannel--X']}}` to the task's input X, wired
    to a root parameter, and takes its *string* value (backend/src/v2/driver/driver.go, initPodSpecPatch ->
    getPodResource -> resolvePodSpecInputRuntimeParameter -> GetStringValue; a number would resolve to ""),
    takes the image and env from the executor's container the same way, and the Secret from
    secretNameParameter before secretName (backend/src/v2/driver/k8s.go, extendPodSpecPatch)."""
    spec_doc = version_of(changed_render(render_chart, tmp_path))["spec"]
    spec, platform = spec_doc["pipelineSpec"], spec_doc["platformSpec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    root = spec["root"]["inputDefinitions"]["parameters"]
    wanted = {"cpu_request": "1", "cpu_limit": "4", "memory_request": "2Gi", "memory_limit": "64Gi", "accelerator_count": "0",
              "accelerator_type": "amd.com/gpu", "step_cpu_request": "250m", "step_cpu_limit": "2", "step_memory_request": "1Gi",
              "step_memory_limit": "8Gi"}  # fmt: skip
    seen_training = seen_steps = 0
    for task_name, task in flat_tasks(spec).items():
        label = spec["components"][task["componentRef"]["name"]]["executorLabel"]
        container = spec["deploymentSpec"]["executors"][label]["container"]
        training = container["image"] == "registry.example.com/ml/fedpipe:1.2.3-cuda12"
        assert training or container["image"] == "registry.example.com/ml/fedpipe:1.2.3", f"{task_name} runs {container['image']}"
        assert training == task["componentRef"]["name"].startswith("comp-train-phase"), (
            f"{task_name}: training image on the wrong task"
        )
        resources = container["resources"]
        placeholders = {field: resources[field] for field in RESOURCE_FIELDS if field in resources}
        placeholders |= {f"accelerator.{k}": v for k, v in resources.get("accelerator", {}).items()}
        assert set(placeholders) >= set(RESOURCE_FIELDS), (
            f"{task_name} sets no runtime {set(RESOURCE_FIELDS) - set(placeholders)}"
        )
        for field, placeholder in placeholders.items():
            channel = PLACEHOLDER.match(placeholder)[1]
            param = task["inputs"]["parameters"][channel]["componentInputParameter"]
            value = root[param]["defaultValue"]
            assert isinstance(value, str) and value == wanted[param], f"{task_name}.{field} resolves to {param}={value!r}"
            assert param.startswith("step_") != training, f"{task_name}.{field} reads {param}"
        seen_training += training
        seen_steps += not training
        assert {e["name"]: e["value"] for e in container["env"]}["FEDPIPE_S3_ENDPOINT"] == "http://s3.example.com:9000"
        for source in platform[label]["secretAsEnv"]:
            assert source["secretNameParameter"]["runtimeValue"]["constant"] == source["secretName"] == "team-s3"
            assert {p["envVar"]: p["secretKey"] for p in source["keyToEnv"]} == {
                "AWS_ACCESS_KEY_ID": "access",
                "AWS_SECRET_ACCESS_KEY": "secret",
            }
    assert seen_training and seen_steps
    assert root["telemetry_pushgateway"]["defaultValue"] == EXTERNAL_PUSHGATEWAY


# --- what native mode refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "nativeMode.enabled=true", "--set", "signing.enabled=false"], "set register.enabled=false as well"),
        ([*NATIVE, "--set", "schedule.cron=0 0 3 * * *"], "schedule.cron (0 0 3 * * *) needs the registration Job"),
        (
            [*NATIVE, "--set", "pytorchJob.enabled=true", "--set", "pytorchJob.phase=personalization"],
            "pytorchJob.phase (personalization) changes the pipeline's shape",
        ),
        ([*NATIVE, "--set", "pipeline.method=no_such_method"], "pipeline.method no_such_method has no precompiled pipeline"),
        ([*NATIVE, "--set", "pipeline.name=My Pipeline"], "is not a Kubernetes name"),
        ([*NATIVE, "--set", "pipeline.name=" + "a" * 64], "is not a Kubernetes name"),
        (
            [*NATIVE, "--set", "runConfig.partition.scheme=dirichlet"],
            "runConfig.partition.scheme=dirichlet is fixed by the precompiled",
        ),
        (
            [*NATIVE, "--set", "runConfig.telemetry.pipeline=mine"],
            "runConfig.telemetry.pipeline=mine is fixed by the precompiled",
        ),
        ([*NATIVE, "--set", "runConfig.train.lrr=0.1"], "runConfig.train.lrr is not a field of the precompiled superfed_mm"),
        (
            [*NATIVE, "--set-string", "runConfig.train.rounds=many"],
            "runConfig.train.rounds=many does not fit its pipeline parameter train_rounds (NUMBER_INTEGER)",
        ),
        ([*NATIVE, "--set", "runConfig.train.rounds=2.5"], "does not fit its pipeline parameter train_rounds"),
        (
            [*NATIVE, "--set", "runConfig.telemetry.progress=1"],
            "does not fit its pipeline parameter telemetry_progress (BOOLEAN)",
        ),
        (
            [*NATIVE, "--set", "runConfig.partition.feature_shift=rotate"],
            "is a string, but the superfed_mm pipeline's config holds a list",
        ),
        (
            [*NATIVE, "--set", "runConfig.run.threads=2"],
            "runConfig.run.threads=2 has no run parameter in the precompiled superfed_mm pipeline",
        ),
    ],
    ids=[
        "register-job-on",
        "schedule",
        "distributed-phase",
        "unknown-method",
        "name-chars",
        "name-length",
        "fixed-scheme",
        "fixed-pipeline-label",
        "unknown-field",
        "string-for-int",
        "fraction-for-int",
        "int-for-bool",
        "string-for-list",
        "null-field-scalar",
    ],
)
def test_what_a_precompiled_pipeline_cannot_do_fails_with_a_message(helm: str, args: list[str], message: str):
    proc = run_tool([helm, "template", RELEASE, str(CHART), *CLUSTER, *args], check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_helm_lint_strict_passes_with_native_mode(helm: str, tmp_path):
    values = tmp_path / "native.yaml"
    values.write_text(
        yaml.safe_dump({"nativeMode": {"enabled": True}, "register": {"enabled": False}, "signing": {"enabled": False},
                        "runConfig": CHANGED_CONFIG})
    )
    out = run_tool([helm, "lint", str(CHART), "--strict", "-f", str(values)]).stdout
    assert "0 chart(s) failed" in out, out


def test_the_pipeline_names_the_credentials_secret_but_never_holds_a_credential(render_chart):
    docs = native(
        render_chart,
        "--set",
        "storage.createSecret=true",
        "--set",
        "storage.accessKey=dummy-access",
        "--set",
        "storage.secretKey=dummy-secret",
    )
    text = json.dumps([d for d in docs if d["kind"] in ("Pipeline", "PipelineVersion")])
    assert "dummy-access" not in text and "dummy-secret" not in text
    assert f'"secretName": "{RELEASE}-storage"' in text, "the tasks read the chart's Secret"
