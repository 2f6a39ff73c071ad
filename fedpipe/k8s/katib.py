"""A study's tuning as Katib Experiments (kubeflow.org/v1beta1, Katib v0.19 = Kubeflow 1.11 / 26.03): the one
place their manifests are made.

One Experiment per method tunes that method's search space (`fedpipe.search_space`: COMMON_SPACE plus the
method's `Params.search_space`, or what the study file sets). Each trial is a batch/v1 Job whose one
container runs, in fedpipe's image,

    fedpipe study trial -c /etc/fedpipe/study/study.yaml --method METHOD --param PATH=${trialParameters.NAME} ...

with the study file from a ConfigMap (`study_configmap`) mounted at /etc/fedpipe/study. The trial trains on
the clients' training splits, scores on their validation splits and prints, as its last lines, one
`NAME=VALUE` line per metric; Katib's StdOut metrics collector reads them.

How Katib v0.19.0 treats what is made here (github.com/kubeflow/katib at tag v0.19.0):

- Its webhook (pkg/webhook/v1beta1/experiment/validator/validator.go) refuses an Experiment name that is
  not `^[a-z]([-a-z0-9]*[a-z0-9])?` or longer than 40 characters, a `${trialParameters.X}` without a
  trialParameter (and the reverse), metadata.name/namespace in the trial spec, and a batch/v1 Job that
  does not survive conversion to the Go type (an unknown field). The CRD itself is schemaless.
- The StdOut collector (pkg/webhook/v1beta1/pod/utils.go, wrapWorkerContainer) rewrites the primary
  container's command into `sh -c "<command and args joined by spaces> 1>/var/log/katib/metrics.log 2>&1
  && echo completed > /var/log/katib/$$$$.pid"`: the command must be set (else Katib asks the registry for
  the image's entrypoint), every word of it must be shell-safe (a categorical value is checked here), and
  the container's own log is empty (stdout and stderr go to the file). A sidecar then parses that file
  with DefaultFilter (below) and reports to katib-db-manager; a line counts only if it contains a metric
  name, and every `name=value` match on it counts: the trial must print each metric once, at the end.
- The pod gets `sidecar.istio.io/inject: "false"`: in a Kubeflow profile namespace (istio-injection:
  enabled) an Istio sidecar would keep running after the trial ends, so the Job would never complete,
  and the metrics collector, which shares the pod's process namespace and waits for every other process
  to exit, would never report (Katib's own advice: docs/proposals/1214-custom-crd-in-trial).
  katib-db-manager runs outside the mesh, so the collector's plaintext gRPC reaches it.
- The namespace needs the label `katib.kubeflow.org/metrics-collector-injection: enabled` (the pod
  webhook's namespaceSelector, manifests/v1beta1/components/webhook/webhooks.yaml); Kubeflow profile
  namespaces have it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from itertools import product

from fedpipe.errors import ConfigError
from fedpipe.k8s.phasejob import CONTAINER_SECURITY_CONTEXT, KUEUE_QUEUE_LABEL, POD_SECURITY_CONTEXT, StorageAccess, env
from fedpipe.search_space import Choice, Dimension, IntRange, LogUniform, Uniform

__all__ = [
    "ADDITIONAL_METRICS", "ALGORITHMS", "API_VERSION", "CONTAINER", "DEFAULT_FILTER", "JOB_FAILURE_CONDITION",
    "JOB_SUCCESS_CONDITION", "KIND", "OBJECTIVE_METRIC", "STUDY_FILE", "STUDY_PATH", "experiment_name",
    "katib_experiment", "katib_manifests", "study_configmap", "study_configmap_name", "trial_parameter_name",
]  # fmt: skip

API_VERSION = "kubeflow.org/v1beta1"
KIND = "Experiment"
CONTAINER = "trial"  # the trial Job's container: spec.trialTemplate.primaryContainerName
STUDY_DIR = "/etc/fedpipe/study"
STUDY_FILE = "study.yaml"
STUDY_PATH = f"{STUDY_DIR}/{STUDY_FILE}"
OBJECTIVE_METRIC = "val_personalized_accuracy"
ADDITIONAL_METRICS = ("val_global_accuracy", "val_worst10_accuracy")
#: Katib's StdOut/File collector filter, set explicitly and equal to its default (DefaultFilter,
#: pkg/metricscollector/v1beta1/common/const.go at v0.19.0), so a later Katib default cannot change it.
DEFAULT_FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"
#: Katib's defaults for a batch/v1 Job trial (DefaultJobSuccessCondition / DefaultJobFailureCondition,
#: pkg/apis/controller/experiments/v1beta1/constants.go at v0.19.0): GJSON paths over the Job's status.
JOB_SUCCESS_CONDITION = 'status.conditions.#(type=="Complete")#|#(status=="True")#'
JOB_FAILURE_CONDITION = 'status.conditions.#(type=="Failed")#|#(status=="True")#'
#: The suggestion algorithms of Katib v0.19.0's katib-config (suggestions served by hyperopt: random, tpe;
#: optuna: grid, multivariate-tpe; skopt: bayesianoptimization; goptuna: cmaes, sobol), and whether each
#: takes the `random_state` setting (sobol's sampler has no seed; hyperband and the NAS ones are not for this).
ALGORITHMS = {"random": True, "tpe": True, "grid": True, "multivariate-tpe": True, "bayesianoptimization": True,
              "cmaes": True, "sobol": False}  # fmt: skip
MAX_EXPERIMENT_NAME = 40  # Katib's webhook; a trial (and its Job) is named <experiment>-<8 characters>
METRIC_NAME = re.compile(r"[\w|-]+", re.ASCII)  # what DefaultFilter's first group can capture
SHELL_SAFE = re.compile(r"[A-Za-z0-9_.:/+-]+")  # a word that `sh -c` passes through unchanged


def _dns_label(text: str, most: int) -> str:
    """Lowercase alphanumerics and '-', starting with a letter, ending alphanumeric, at most `most`
    characters; a cut name ends with a hash of the whole, so two long names stay apart."""
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not label[:1].isalpha():
        label = f"s-{label}".rstrip("-")
    if len(label) > most:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        label = f"{label[: most - 7].rstrip('-')}-{digest}"
    return label


def experiment_name(study_name: str, method: str) -> str:
    """`<study>-<method>`, underscores as '-', valid for Katib (a DNS-1035 label of at most 40 characters)."""
    return _dns_label(f"{study_name}-{method}", MAX_EXPERIMENT_NAME)


def study_configmap_name(study_name: str) -> str:
    return _dns_label(f"{study_name}-study", 63)


def trial_parameter_name(path: str) -> str:
    """The trialParameter for a config path: `train.lr` -> `train_lr` (no dots in `${trialParameters.X}`)."""
    return re.sub(r"\W", "_", path, flags=re.ASCII)


def _labels(study_name: str | None = None, method: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "fedpipe", "app.kubernetes.io/part-of": "fedpipe", "app.kubernetes.io/component": "study"}
    if study_name:
        out["fedpipe.io/study"] = _dns_label(study_name, 63)
    if method:
        out["fedpipe.io/method"] = _dns_label(method, 63)
    return out


def study_configmap(name: str, namespace: str, study_yaml_text: str) -> dict:
    """The ConfigMap holding the study file, which every trial mounts at /etc/fedpipe/study/study.yaml."""
    if len(study_yaml_text.encode()) >= 1024 * 1024:
        raise ConfigError("the study file is over 1 MiB, more than a ConfigMap holds")
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": _labels()},
            "data": {STUDY_FILE: study_yaml_text}}  # fmt: skip


def _number(value: float | int) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else repr(float(value))


def _word(value) -> str:
    """A categorical value as Katib substitutes it into the command: YAML's spelling of booleans; a
    string only if the shell passes it through unchanged."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _number(value)
    if isinstance(value, str) and SHELL_SAFE.fullmatch(value):
        return value
    raise ConfigError(
        f"choice value {value!r}: Katib runs the trial through `sh -c`, so a string value may hold only "
        "letters, digits and _ . : / + -"
    )


def _parameter(path: str, dim: Dimension, grid_points: int | None) -> dict:
    """One spec.parameters entry. With the grid algorithm, numeric ranges become `discrete` lists of
    `grid_points` values (Dimension.grid: log-spaced for LogUniform), since Katib's grid needs a step."""
    if isinstance(dim, Choice) or grid_points:
        values = [_word(v) for v in (dim.values if isinstance(dim, Choice) else dim.grid(grid_points))]
        if len(set(values)) != len(values):
            raise ConfigError(f"search space {path!r}: values {values} repeat")
        return {"name": path, "parameterType": "categorical" if isinstance(dim, Choice) else "discrete",
                "feasibleSpace": {"list": values}}  # fmt: skip
    kinds = {LogUniform: ("double", "logUniform"), Uniform: ("double", "uniform"), IntRange: ("int", "uniform")}
    if type(dim) not in kinds:
        raise ConfigError(f"search space {path!r}: {dim!r} is not a fedpipe.search_space dimension")
    ptype, distribution = kinds[type(dim)]
    return {"name": path, "parameterType": ptype,
            "feasibleSpace": {"min": _number(dim.low), "max": _number(dim.high), "distribution": distribution}}  # fmt: skip


def _check_settings(
    space: Mapping[str, Dimension], metrics: Sequence[str], algorithm: str, seed: int, max_trials: int, parallel_trials: int
) -> None:
    problems = []
    if not space:
        problems.append("the search space is empty")
    names = [trial_parameter_name(path) for path in space]
    if len(set(names)) != len(names):
        problems.append(f"search-space paths {list(space)} give the same trial parameter name twice")
    bad = [m for m in metrics if not METRIC_NAME.fullmatch(m)]
    if bad or len(set(metrics)) != len(metrics):
        problems.append(
            f"metric names must be distinct words (letters, digits, _ | -) that Katib's filter reads: {list(metrics)}"
        )
    if algorithm not in ALGORITHMS:
        problems.append(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if algorithm == "cmaes" and sum(not isinstance(d, Choice) for d in space.values()) < 2:
        problems.append("CMA-ES (Katib's goptuna) needs two or more numeric dimensions")
    if seed < 0:
        problems.append(f"seed must be 0 or more (Katib's random_state), not {seed}")
    if not 1 <= parallel_trials <= max_trials:
        problems.append(f"need 1 <= parallel_trials ({parallel_trials}) <= max_trials ({max_trials})")
    if problems:
        raise ConfigError(f"Katib experiment: {'; '.join(problems)}.")


def _trial_job(
    method: str,
    space: Mapping[str, Dimension],
    *,
    study_name: str,
    image: str,
    study_configmap: str,
    storage: StorageAccess | None,
    resources: dict | None,
    timeout_seconds: int | None,
    queue: str = "",
) -> dict:
    """The trial's batch/v1 Job (no name: Katib names it after the trial), with Katib's placeholders; with
    `queue`, Kueue's queue label on the Job (Kueue's batch/job integration, on by default, admits it)."""
    params = [arg for path in space for arg in ("--param", f"{path}=${{trialParameters.{trial_parameter_name(path)}}}")]
    container = {
        "name": CONTAINER, "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["fedpipe", "study", "trial", "-c", STUDY_PATH, "--method", method, *params],
        # The root filesystem is read-only: caches (torch, datasets) go under HOME=/tmp.
        "env": env(storage) if storage else [{"name": "HOME", "value": "/tmp"}],
        "resources": resources or {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "4", "memory": "16Gi"}},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": "study", "mountPath": STUDY_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }  # fmt: skip
    pod_spec = {
        "restartPolicy": "Never",
        # The trial talks to the store; Katib's collector sidecar to katib-db-manager: no API token needed.
        "automountServiceAccountToken": False,
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [{"name": "study", "configMap": {"name": study_configmap}}, {"name": "tmp", "emptyDir": {}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
    }  # fmt: skip
    # backoffLimit 0: a failed trial is a failed trial (maxFailedTrialCount), not six reruns of it.
    spec = {"backoffLimit": 0, "template": {
        "metadata": {"labels": _labels(study_name, method), "annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": pod_spec}}  # fmt: skip
    if timeout_seconds:
        spec["activeDeadlineSeconds"] = timeout_seconds
    job = {"apiVersion": "batch/v1", "kind": "Job", "spec": spec}
    if queue:
        job["metadata"] = {"labels": {KUEUE_QUEUE_LABEL: queue}}
    return job


def _parameters(space: Mapping[str, Dimension], grid_points: int | None, max_trials: int) -> list[dict]:
    parameters = [_parameter(path, dim, grid_points) for path, dim in space.items()]
    if grid_points and (combos := len(list(product(*(p["feasibleSpace"]["list"] for p in parameters))))) < max_trials:
        raise ConfigError(f"Katib's grid has {combos} points here, fewer than max_trials={max_trials}: raise grid_points")
    return parameters


def _objective(objective_metric: str, extra: list[str], goal: float | None) -> dict:
    objective = {
        "type": "maximize", "objectiveMetricName": objective_metric, "additionalMetricNames": extra,
        # Each metric is printed once; `latest` takes that line (Katib's default for maximize is the max
        # over every matching line of the log).
        "metricStrategies": [{"name": m, "value": "latest"} for m in [objective_metric, *extra]],
    }  # fmt: skip
    if goal is not None:
        objective["goal"] = float(goal)
    return objective


def _trial_template(method: str, space: Mapping[str, Dimension], job: dict) -> dict:
    return {
        "primaryContainerName": CONTAINER,
        "successCondition": JOB_SUCCESS_CONDITION, "failureCondition": JOB_FAILURE_CONDITION,
        "trialParameters": [{"name": trial_parameter_name(path), "reference": path, "description": f"{method}: {path}"}
                            for path in space],
        "trialSpec": job,
    }  # fmt: skip


def katib_experiment(
    study_name: str, method: str, space: Mapping[str, Dimension], *, namespace: str, image: str,
    objective_metric: str = OBJECTIVE_METRIC, additional_metrics: Sequence[str] = ADDITIONAL_METRICS,
    goal: float | None = None, max_trials: int, parallel_trials: int, max_failed_trials: int | None = None,
    algorithm: str = "tpe", seed: int, study_configmap: str, storage: StorageAccess | None = None,
    resources: dict | None = None, grid_points: int = 3, trial_timeout_seconds: int | None = None, queue: str = "",
) -> dict:  # fmt: skip
    """The Katib Experiment that tunes `method` over `space` ({config path: Dimension}), maximizing
    `objective_metric` on validation. `storage`: the store endpoint and credentials Secret the trial
    pods get, as the PyTorchJob's pods do (FEDPIPE_S3_ENDPOINT, AWS_* by secretKeyRef); `resources`: the
    trial container's ResourceRequirements (default 1-4 CPUs, 2-16Gi); `max_failed_trials` defaults to
    `parallel_trials` (a whole wave failing means a broken setup); `grid_points`: values per numeric
    dimension with algorithm="grid"; `trial_timeout_seconds`: the trial Job's activeDeadlineSeconds; `queue`:
    Kueue's LocalQueue the trial Jobs wait in (empty: none)."""
    extra = [m for m in additional_metrics if m != objective_metric]
    _check_settings(space, [objective_metric, *extra], algorithm, seed, max_trials, parallel_trials)
    job = _trial_job(method, space, study_name=study_name, image=image, study_configmap=study_configmap,
                     storage=storage, resources=resources, timeout_seconds=trial_timeout_seconds, queue=queue)  # fmt: skip
    spec = {
        "objective": _objective(objective_metric, extra, goal),
        "algorithm": {"algorithmName": algorithm,
                      "algorithmSettings": [{"name": "random_state", "value": str(seed)}] if ALGORITHMS[algorithm] else []},
        "parallelTrialCount": parallel_trials, "maxTrialCount": max_trials,
        "maxFailedTrialCount": min(max_failed_trials if max_failed_trials is not None else parallel_trials, max_trials),
        "parameters": _parameters(space, grid_points if algorithm == "grid" else None, max_trials),
        "metricsCollectorSpec": {"collector": {"kind": "StdOut"}, "source": {"filter": {"metricsFormat": [DEFAULT_FILTER]}}},
        "trialTemplate": _trial_template(method, space, job),
    }  # fmt: skip
    metadata = {"name": experiment_name(study_name, method), "namespace": namespace, "labels": _labels(study_name, method),
                "annotations": {"fedpipe.io/study": study_name, "fedpipe.io/method": method}}  # fmt: skip
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def katib_manifests(
    study_yaml_text: str, study_name: str, methods_and_spaces: Mapping[str, Mapping[str, Dimension]], **options
) -> list[dict]:
    """The study's ConfigMap, then one Experiment per method ({method: its full search space}, e.g.
    COMMON_SPACE | ALGORITHMS[method].Params.search_space). `options` are katib_experiment's keyword
    arguments (namespace, image, max_trials, parallel_trials and seed are required; not study_configmap)."""
    if not methods_and_spaces:
        raise ConfigError("the study tunes no method")
    configmap = study_configmap(study_configmap_name(study_name), options["namespace"], study_yaml_text)
    experiments = [
        katib_experiment(study_name, method, space, study_configmap=configmap["metadata"]["name"], **options)
        for method, space in methods_and_spaces.items()
    ]
    names = [e["metadata"]["name"] for e in experiments]
    if len(set(names)) != len(names):
        raise ConfigError(f"two methods give the same Experiment name: {names}")
    return [configmap, *experiments]
