"""A study's Katib Experiments (fedpipe.k8s.katib) against what Katib v0.19.0 (Kubeflow 1.11 / 26.03) does.

Everything Katib-side here is transcribed from github.com/kubeflow/katib at tag v0.19.0 (commit 578e60f1ce83),
read through a stored copy of the repository (`git show v0.19.0:PATH`):

- the Experiment CRD's openAPIV3Schema (manifests/v1beta1/components/crd/experiment.yaml): schemaless
  (`x-kubernetes-preserve-unknown-fields: true`), so the API server keeps anything; Katib's webhooks decode
  the object into its Go types, which pkg/apis/v1beta1/swagger.json describes (both vendored under
  tests/deploy/schemas/, README.md there);
- the experiment validating webhook's rules (pkg/webhook/v1beta1/experiment/validator/validator.go,
  ValidateExperiment), and each suggestion service's ValidateAlgorithmSettings (pkg/suggestion/v1beta1/
  hyperopt/service.py, optuna/service.py, skopt/service.py, goptuna/service.go);
- the StdOut collector's filter and parser (pkg/metricscollector/v1beta1/common/const.go DefaultFilter,
  pkg/metricscollector/v1beta1/file-metricscollector/file-metricscollector.go parseLogsInTextFormat);
- how the pod webhook wraps the trial's command (pkg/webhook/v1beta1/pod/utils.go wrapWorkerContainer).

No Katib runs here: the controller, the suggestion services and the collector sidecar are modelled, not run.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from itertools import product
from pathlib import Path

import pytest
import yaml
from deploytools import NAMESPACE, crd_schema_problems

from fedpipe.algorithms import ALGORITHMS
from fedpipe.errors import ConfigError
from fedpipe.k8s import katib
from fedpipe.k8s.phasejob import StorageAccess
from fedpipe.search_space import COMMON_SPACE, Choice, IntRange, LogUniform, Uniform

SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMA = SCHEMAS / "kubeflow.org_experiments.v1beta1.json"
TYPES_SCHEMA = SCHEMAS / "katib.v1beta1.experiment.schema.json"
IMAGE = "ghcr.io/fedpipe/fedpipe:0.2.0-cuda"
STUDY_YAML = "study:\n  name: mnist5k-tuning\n  objective: val_personalized_accuracy\n"

# kubeflow/katib v0.19.0, pkg/metricscollector/v1beta1/common/const.go, DefaultFilter (verbatim):
KATIB_DEFAULT_FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"
# kubeflow/katib v0.19.0, pkg/apis/controller/experiments/v1beta1/constants.go (verbatim, Go-unquoted):
KATIB_JOB_SUCCESS = 'status.conditions.#(type=="Complete")#|#(status=="True")#'  # DefaultJobSuccessCondition
KATIB_JOB_FAILURE = 'status.conditions.#(type=="Failed")#|#(status=="True")#'  # DefaultJobFailureCondition
# kubeflow/katib v0.19.0, pkg/controller.v1beta1/consts/const.go: TrialTemplateParamReplaceFormat(Regex)
PLACEHOLDER = re.compile(r"\$\{trialParameters\..+?\}")
# manifests/v1beta1/installs/katib-standalone/katib-config.yaml: runtime.suggestions[].algorithmName
KATIB_CONFIG_SUGGESTIONS = {"random", "tpe", "grid", "hyperband", "bayesianoptimization", "cmaes", "sobol",
                            "multivariate-tpe", "enas", "darts", "pbt"}  # fmt: skip
# The settings each suggestion service's ValidateAlgorithmSettings accepts (None: it checks none).
ALGORITHM_SETTINGS = {
    "tpe": {"gamma", "prior_weight", "n_EI_candidates", "random_state"},  # hyperopt
    "random": {"random_state"},  # hyperopt
    "grid": {"random_state"},  # optuna
    "multivariate-tpe": {"n_startup_trials", "n_ei_candidates", "random_state"},  # optuna
    "bayesianoptimization": {"base_estimator", "n_initial_points", "acq_func", "acq_optimizer", "random_state"},  # skopt
    "cmaes": None, "sobol": None,  # goptuna
}  # fmt: skip


def space(method: str) -> dict:
    return COMMON_SPACE | ALGORITHMS[method].Params.search_space


# A Choice the methods do not declare yet: booleans and numbers, as a study file may set them.
CHOICE_SPACE = COMMON_SPACE | {"method.mix_bias": Choice((True, False)), "train.batch_size": Choice((16, 32, 64)),
                               "method.nu": Uniform(0.0, 5.0)}  # fmt: skip
SPACES = {"superfed_mm": space("superfed_mm"), "ifca": space("ifca"), "superfed_lm": CHOICE_SPACE, "fedavg": space("fedavg")}


def experiment(method: str = "superfed_mm", sp: dict | None = None, **options) -> dict:
    kwargs = {"namespace": NAMESPACE, "image": IMAGE, "max_trials": 24, "parallel_trials": 3, "seed": 7,
              "study_configmap": "mnist5k-tuning-study"} | options  # fmt: skip
    return katib.katib_experiment("mnist5k_tuning", method, SPACES[method] if sp is None else sp, **kwargs)


# --- what Katib refuses ------------------------------------------------------------------------------


def template_text(spec: dict) -> str:
    """The trial template as the webhook reads it (GetTrialTemplate: the trialSpec marshalled to JSON)."""
    return json.dumps(spec["trialTemplate"]["trialSpec"], sort_keys=True)


def _trial_template_problems(spec: dict) -> list[str]:
    """validateTrialTemplate (validator.go)."""
    tt = spec.get("trialTemplate") or {}
    problems = [
        f"trialTemplate.{k} must be specified"
        for k in ("primaryContainerName", "successCondition", "failureCondition", "trialParameters")
        if not tt.get(k)
    ]
    if ("trialSpec" in tt) == ("configMap" in tt):
        return [*problems, "exactly one of trialSpec and configMap"]
    text, names, refs = template_text(spec), set(), set()
    known = {p.get("name") for p in spec.get("parameters", [])}
    for tp in tt.get("trialParameters", []):
        name, ref = tp.get("name", ""), tp.get("reference", "")
        if not name or not ref or "{" in name or "}" in name or name in names or ref in refs:
            problems.append(f"trialParameter {tp}: name/reference missing, duplicated or with braces")
            continue
        names.add(name), refs.add(ref)
        if ref not in known:
            problems.append(f"trialParameter reference {ref} is not in spec.parameters")
        if f"${{trialParameters.{name}}}" not in text:
            problems.append(f"trialParameter {name} is not used in the trial template")
        text = text.replace(f"${{trialParameters.{name}}}", "test-value")
    problems += [f"{p} in the trial template has no trialParameter" for p in PLACEHOLDER.findall(text)]
    job = json.loads(text)
    if (job.get("metadata") or {}).get("name") or (job.get("metadata") or {}).get("namespace"):
        problems.append("metadata.name and metadata.namespace in the trial template must be omitted")
    if not (job.get("apiVersion") and job.get("kind")):
        problems.append("apiVersion and kind of the trial template must be set")
    return problems


def _parameter_problems(spec: dict) -> list[str]:
    """validateParameters (validator.go)."""
    problems = []
    for p in spec.get("parameters") or []:
        fs, ptype = p.get("feasibleSpace") or {}, p.get("parameterType")
        if ptype not in ("int", "double", "categorical", "discrete", "unknown"):
            problems.append(f"{p['name']}: parameterType {ptype} is not supported")
        if fs.get("distribution", "") not in ("", "uniform", "logUniform", "normal", "logNormal", "unknown"):
            problems.append(f"{p['name']}: distribution {fs['distribution']} is not supported")
        if not fs:
            problems.append(f"{p['name']}: feasibleSpace must be specified")
        elif ptype in ("int", "double") and (fs.get("list") or not fs.get("min") or not fs.get("max")):
            problems.append(f"{p['name']}: {ptype} needs min and max, no list")
        elif ptype in ("categorical", "discrete") and (fs.get("min") or fs.get("max") or fs.get("step")):
            problems.append(f"{p['name']}: {ptype} takes no min, max or step")
    return problems


def webhook_problems(doc: dict) -> list[str]:
    """What Katib's experiment validating webhook refuses (ValidateExperiment, validator.go, v0.19.0)."""
    spec, problems = doc["spec"], []
    name = doc["metadata"].get("name", "")
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 40:
        problems.append(f"metadata.name {name!r} is not a valid Experiment name of at most 40 characters")
    most, parallel, failed = spec.get("maxTrialCount"), spec.get("parallelTrialCount"), spec.get("maxFailedTrialCount")
    if (most is not None and most <= 0) or (parallel is not None and parallel <= 0) or (failed is not None and failed < 0):
        problems.append("trial counts out of range")
    if most is not None and ((failed or 0) > most or (parallel or 0) > most):
        problems.append("maxFailedTrialCount and parallelTrialCount must not exceed maxTrialCount")
    objective = spec.get("objective") or {}
    if objective.get("type") not in ("minimize", "maximize") or not objective.get("objectiveMetricName"):
        problems.append("objective.type and objective.objectiveMetricName must be set")
    if objective.get("objectiveMetricName") in objective.get("additionalMetricNames", []):
        problems.append("additionalMetricNames should not contain the objective")
    if (spec.get("algorithm") or {}).get("algorithmName") not in KATIB_CONFIG_SUGGESTIONS:
        problems.append("algorithm.algorithmName has no suggestion service in katib-config")
    if not spec.get("parameters"):
        problems.append("spec.parameters must be specified")
    collector = spec.get("metricsCollectorSpec", {}).get("collector", {}).get("kind", "StdOut")
    if collector not in ("StdOut", "File", "TensorFlowEvent", "PrometheusMetric", "Custom", "Push", "None"):
        problems.append(f"metrics collector kind {collector}")
    for f in spec.get("metricsCollectorSpec", {}).get("source", {}).get("filter", {}).get("metricsFormat", []):
        if not re.match(r".*\(.*\).*\(.*\).*", f):
            problems.append(f"filter {f}: two top subexpressions are required")
    return problems + _parameter_problems(spec) + _trial_template_problems(spec)


def suggestion_problems(doc: dict) -> list[str]:
    """What the algorithm's suggestion service refuses in ValidateAlgorithmSettings (the Experiment then fails)."""
    spec = doc["spec"]
    algorithm = spec["algorithm"]
    name, settings = algorithm["algorithmName"], algorithm.get("algorithmSettings", [])
    allowed, problems = ALGORITHM_SETTINGS.get(name, set()), []
    for s in settings:
        if allowed is not None and s["name"] not in allowed:
            problems.append(f"unknown setting {s['name']} for algorithm {name}")
        if s["name"] == "random_state" and not (re.fullmatch(r"\d+", s["value"])):
            problems.append(f"random_state should be an integer >= 0, not {s['value']!r}")
    numeric = [p for p in spec["parameters"] if p["parameterType"] in ("int", "double")]
    if name == "cmaes" and len(numeric) < 2:
        problems.append("CMA-ES only supports two or more dimensional continuous search space")
    if name == "grid":  # optuna's HyperParameterSearchSpace.convert_to_combinations
        if any(p["parameterType"] == "double" and not p["feasibleSpace"].get("step") for p in numeric):
            problems.append("grid: every double parameter needs a step")
        elif (
            not numeric and len(list(product(*(p["feasibleSpace"]["list"] for p in spec["parameters"])))) < spec["maxTrialCount"]
        ):
            problems.append("grid: maxTrialCount > all possible search combinations")
    return problems


def experiment_problems(doc: dict) -> list[str]:
    """The API server (the CRD's schema), then the webhooks, which first decode the object into Katib's Go
    types (a wrong type ends there), then the suggestion service."""
    decoded = crd_schema_problems(CRD_SCHEMA, doc) + crd_schema_problems(TYPES_SCHEMA, doc)
    return decoded or webhook_problems(doc) + suggestion_problems(doc)


def trial_job(doc: dict, values: dict[str, str] | None = None, name: str = "trial-job") -> dict:
    """The Job Katib creates for one trial: the placeholders replaced by the assignment (by default each
    parameter's first value), named after the trial, in the Experiment's namespace."""
    spec = doc["spec"]
    chosen = {p["name"]: (p["feasibleSpace"].get("list") or [p["feasibleSpace"].get("min")])[0] for p in spec["parameters"]} | (
        values or {}
    )
    text = template_text(spec)
    for tp in spec["trialTemplate"]["trialParameters"]:
        text = text.replace(f"${{trialParameters.{tp['name']}}}", chosen[tp["reference"]])
    job = json.loads(text)
    job["metadata"] = {"name": f"{doc['metadata']['name']}-{name}"[:63], "namespace": doc["metadata"]["namespace"]}
    return job


def container(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


# --- the StdOut collector ----------------------------------------------------------------------------


def collect(lines: list[str], metrics: list[str], filters: tuple[str, ...] = (KATIB_DEFAULT_FILTER,)) -> dict[str, list[str]]:
    """parseLogsInTextFormat + newObservationLog (file-metricscollector.go): a line counts only if it
    contains a metric name; every match of every filter on it (FindAllStringSubmatch: group 1 the name,
    group 2 the value, both trimmed) whose name is a metric is recorded; no objective -> 'unavailable'.
    Go's RE2 \\w is ASCII-only, hence re.ASCII."""
    found: dict[str, list[str]] = {}
    for line in lines:
        if not any(m in line for m in metrics):
            continue
        for f in filters:
            for match in re.finditer(f, line, re.ASCII):
                name, value = match.group(1).strip(), match.group(2).strip()
                if name in metrics:
                    found.setdefault(name, []).append(value)
    return found if metrics[0] in found else {metrics[0]: ["unavailable"]}


def test_filter_is_katibs_default():
    assert katib.DEFAULT_FILTER == KATIB_DEFAULT_FILTER
    doc = experiment()
    assert doc["spec"]["metricsCollectorSpec"] == {"collector": {"kind": "StdOut"},
                                                   "source": {"filter": {"metricsFormat": [KATIB_DEFAULT_FILTER]}}}  # fmt: skip


def test_trial_metric_lines_parse():
    metrics = [katib.OBJECTIVE_METRIC, *katib.ADDITIONAL_METRICS]
    log = ["INFO loading mnist5k", "round 3 loss 0.2",
           "round 3/10: 100%|██████████| 20/20 [00:02<00:00, 9.52it/s, loss=0.201]",
           "val_personalized_accuracy=0.9312", "val_global_accuracy=8.5e-01", "val_worst10_accuracy=1E0"]  # fmt: skip
    assert collect(log, metrics) == {"val_personalized_accuracy": ["0.9312"], "val_global_accuracy": ["8.5e-01"],
                                     "val_worst10_accuracy": ["1E0"]}  # fmt: skip
    assert collect(["val_personalized_accuracy=-7.53e-05"], metrics) == {"val_personalized_accuracy": ["-7.53e-05"]}
    # Python's own spelling of the values a trial prints (f"{name}={value}") parses back to the same float.
    for value in (0.9312, 1e-05, 0.1 + 0.2, 1.0, 0):
        (got,) = collect([f"{katib.OBJECTIVE_METRIC}={value}"], metrics)[katib.OBJECTIVE_METRIC]
        assert float(got) == value


@pytest.mark.parametrize("line", [
    "round 3 loss 0.2",
    "round 3/10: 100%|██████████| 20/20 [00:02<00:00, 9.52it/s, loss=0.201]",
    "val_personalized_accuracy: 0.93",  # a colon is no '='
    "val_global_accuracy=0.93",  # another metric only
    "best val_personalized_accuracy so far 0.93 at round 3",
])  # fmt: skip
def test_other_lines_give_no_objective(line):
    assert collect([line], [katib.OBJECTIVE_METRIC, *katib.ADDITIONAL_METRICS])[katib.OBJECTIVE_METRIC] == ["unavailable"]


def test_nan_is_no_number():
    """`name=nan` matches with an empty value (the value group may match nothing): Katib records ''
    (not a float), so a trial must not print a NaN objective."""
    assert collect(["val_personalized_accuracy=nan"], [katib.OBJECTIVE_METRIC]) == {katib.OBJECTIVE_METRIC: [""]}


def test_each_metric_is_taken_as_printed():
    """Every matching line counts, in any log line (stderr too: both go to the file), and Katib's default
    strategy for a maximized objective is the max over them; the Experiment asks for `latest`, and the
    trial prints each metric once (ties in time are unordered in katib-db-manager's ORDER BY time)."""
    lines = ["round 2 val_personalized_accuracy=0.99", "val_personalized_accuracy=0.93"]
    assert collect(lines, [katib.OBJECTIVE_METRIC])[katib.OBJECTIVE_METRIC] == ["0.99", "0.93"]
    objective = experiment()["spec"]["objective"]
    assert objective["metricStrategies"] == [
        {"name": m, "value": "latest"} for m in [katib.OBJECTIVE_METRIC, *katib.ADDITIONAL_METRICS]
    ]


# --- the Experiments against the schemas and the webhooks --------------------------------------------


def test_vendored_crd_schema_is_schemaless():
    """The v0.19.0 CRD keeps any object (a wrong type included): the types' schema is what checks fields."""
    schema = json.loads(CRD_SCHEMA.read_text())
    assert schema["x-kubernetes-preserve-unknown-fields"] is True and "properties" not in schema
    broken = experiment()
    broken["spec"]["maxTrialCount"] = "many"
    assert crd_schema_problems(CRD_SCHEMA, broken) == []
    assert crd_schema_problems(TYPES_SCHEMA, broken)


@pytest.mark.parametrize("method", sorted(SPACES))
@pytest.mark.parametrize("algorithm", sorted(katib.ALGORITHMS))
def test_experiment_is_accepted(method, algorithm):
    continuous = len([d for d in SPACES[method].values() if not isinstance(d, Choice)])
    if algorithm == "cmaes" and continuous < 2:  # goptuna's ValidateAlgorithmSettings would refuse it
        with pytest.raises(ConfigError, match="CMA-ES"):
            experiment(method, algorithm=algorithm)
        return
    doc = experiment(method, algorithm=algorithm, grid_points=4, max_trials=4 if algorithm == "grid" else 24)
    assert experiment_problems(doc) == []
    assert doc["apiVersion"] == "kubeflow.org/v1beta1" and doc["kind"] == "Experiment"
    settings = doc["spec"]["algorithm"]["algorithmSettings"]
    assert settings == ([{"name": "random_state", "value": "7"}] if algorithm != "sobol" else [])


BREAKAGES = {
    "random_state as a number": lambda d: d["spec"]["algorithm"]["algorithmSettings"][0].update(value=7),
    "maxTrialCount as a string": lambda d: d["spec"].update(maxTrialCount="24"),
    "feasibleSpace.min as a number": lambda d: d["spec"]["parameters"][0]["feasibleSpace"].update(min=0.003),
    "goal as a string": lambda d: d["spec"]["objective"].update(goal="0.95"),
    "a misspelt field": lambda d: d["spec"].update(parallelTrialCounts=d["spec"].pop("parallelTrialCount")),
    "an unknown distribution": lambda d: d["spec"]["parameters"][0]["feasibleSpace"].update(distribution="loguniform"),
    "a placeholder without trialParameter": lambda d: d["spec"]["trialTemplate"]["trialParameters"].pop(),
    "a trialParameter without placeholder": lambda d: (
        d["spec"]["parameters"].append({"name": "extra", "parameterType": "int", "feasibleSpace": {"min": "1", "max": "2"}}),
        d["spec"]["trialTemplate"]["trialParameters"].append({"name": "extra", "reference": "extra"}),
    ),
    "a name over 40 characters": lambda d: d["metadata"].update(name="a" * 41),
    "the objective among the additional metrics": lambda d: d["spec"]["objective"]["additionalMetricNames"].append(
        katib.OBJECTIVE_METRIC
    ),
    "a trial spec with a name": lambda d: d["spec"]["trialTemplate"]["trialSpec"].update(metadata={"name": "x"}),
    "an unknown tpe setting": lambda d: d["spec"]["algorithm"]["algorithmSettings"].append({"name": "seed", "value": "1"}),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_broken_experiment_is_refused(breakage):
    """The validators are live: each change is refused (a wrong type by the types' schema, the rest by the
    webhook's or the suggestion service's rules)."""
    doc = copy.deepcopy(experiment())
    assert experiment_problems(doc) == []
    BREAKAGES[breakage](doc)
    assert experiment_problems(doc), breakage


@pytest.mark.parametrize("method", sorted(SPACES))
def test_parameters_cover_the_space(method):
    doc = experiment(method)
    spec = doc["spec"]
    params = {p["name"]: p for p in spec["parameters"]}
    assert list(params) == list(SPACES[method])
    trial_params = {tp["name"]: tp["reference"] for tp in spec["trialTemplate"]["trialParameters"]}
    assert sorted(trial_params.values()) == sorted(SPACES[method])
    assert all(re.fullmatch(r"\w+", name, re.ASCII) for name in trial_params)
    used = {p[len("${trialParameters.") : -1] for p in PLACEHOLDER.findall(template_text(spec))}
    assert used == set(trial_params)
    command = container(spec["trialTemplate"]["trialSpec"])["command"]
    assert command[:7] == ["fedpipe", "study", "trial", "-c", "/etc/fedpipe/study/study.yaml", "--method", method]
    pairs = list(zip(command[7::2], command[8::2], strict=True))
    assert pairs == [("--param", f"{path}=${{trialParameters.{name}}}") for name, path in trial_params.items()]
    for path, dim in SPACES[method].items():
        fs = params[path]["feasibleSpace"]
        if isinstance(dim, Choice):
            assert params[path]["parameterType"] == "categorical" and len(fs["list"]) == len(dim.values)
            continue
        expected = {LogUniform: ("double", "logUniform"), Uniform: ("double", "uniform"), IntRange: ("int", "uniform")}[type(dim)]
        assert (params[path]["parameterType"], fs["distribution"]) == expected
        assert (float(fs["min"]), float(fs["max"])) == (dim.low, dim.high)


def test_log_scale_dims():
    params = {p["name"]: p for p in experiment("superfed_mm")["spec"]["parameters"]}
    assert params["train.lr"]["feasibleSpace"] == {"min": "0.001", "max": "0.1", "distribution": "logUniform"}
    assert params["method.mu"]["feasibleSpace"]["distribution"] == "logUniform"
    assert params["method.nu"]["feasibleSpace"]["distribution"] == "uniform"
    ifca = {p["name"]: p for p in experiment("ifca")["spec"]["parameters"]}
    assert ifca["method.clusters"] == {"name": "method.clusters", "parameterType": "int",
                                       "feasibleSpace": {"min": "2", "max": "5", "distribution": "uniform"}}  # fmt: skip


def test_grid_lists_points():
    doc = experiment("superfed_mm", algorithm="grid", grid_points=3, max_trials=81)
    params = {p["name"]: p for p in doc["spec"]["parameters"]}
    assert params["train.lr"] == {
        "name": "train.lr",
        "parameterType": "discrete",
        "feasibleSpace": {"list": ["0.001", "0.01", "0.1"]},
    }
    assert experiment_problems(doc) == []
    with pytest.raises(ConfigError, match="grid"):
        experiment("superfed_mm", algorithm="grid", grid_points=3, max_trials=82)


def test_trial_job_and_configmap_validate(validate_k8s):
    """The Job Katib creates per trial (placeholders replaced), as kubernetes-validate --strict sees it:
    what the webhook's conversion to batch/v1 Job checks (an unknown field fails it)."""
    docs = katib.katib_manifests(STUDY_YAML, "mnist5k_tuning", SPACES, namespace=NAMESPACE, image=IMAGE, max_trials=12,
                                 parallel_trials=3, seed=0,
                                 storage=StorageAccess(s3_endpoint="http://minio-service.kubeflow:9000", s3_secret="mlpipeline-minio-artifact"))  # fmt: skip
    validate_k8s([docs[0], *(trial_job(doc) for doc in docs[1:])])


def test_trial_pod():
    doc = experiment(
        storage=StorageAccess(s3_endpoint="http://minio-service.kubeflow:9000", s3_secret="mlpipeline-minio-artifact")
    )
    tt = doc["spec"]["trialTemplate"]
    assert (tt["successCondition"], tt["failureCondition"]) == (KATIB_JOB_SUCCESS, KATIB_JOB_FAILURE)
    job = tt["trialSpec"]
    assert (job["apiVersion"], job["kind"], "metadata" in job) == ("batch/v1", "Job", False)
    pod = job["spec"]["template"]
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert pod["spec"]["restartPolicy"] == "Never"
    c = container(job)
    assert c["name"] == tt["primaryContainerName"] == katib.CONTAINER and c["image"] == IMAGE
    assert {"name": "study", "mountPath": "/etc/fedpipe/study", "readOnly": True} in c["volumeMounts"]
    assert {"name": "study", "configMap": {"name": "mnist5k-tuning-study"}} in pod["spec"]["volumes"]
    env = {e["name"]: e for e in c["env"]}
    assert env["FEDPIPE_S3_ENDPOINT"]["value"] == "http://minio-service.kubeflow:9000"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": {"name": "mlpipeline-minio-artifact", "key": "accesskey"}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "mlpipeline-minio-artifact", "key": "secretkey"}
    }


def test_command_survives_katibs_shell_wrapping():
    """wrapWorkerContainer joins command and args with spaces under `sh -c`: each word must reach the
    trial unchanged, for every categorical value and a Python-spelled double."""
    doc = experiment("superfed_lm")
    for value in ("true", "false"):
        job = trial_job(doc, {"method.mix_bias": value, "train.lr": "1e-05"})
        words = container(job)["command"]
        wrapped = " ".join([*words, "1>/var/log/katib/metrics.log 2>&1", "&&", "echo completed > /var/log/katib/$$$$.pid"])
        assert shlex.split(wrapped)[: len(words)] == words
        assert f"method.mix_bias={value}" in words and "train.lr=1e-05" in words
    with pytest.raises(ConfigError, match="sh -c"):
        experiment("superfed_lm", CHOICE_SPACE | {"model.name": Choice(("cnn", "my model"))})


def test_names_are_valid_and_distinct():
    long = "a_very_long_study_name_for_the_mnist5k_benchmark_2026"
    names = {katib.experiment_name(long, m) for m in ALGORITHMS}
    assert len(names) == len(ALGORITHMS)
    for name in names | {katib.experiment_name("2026_study", "superfed_mm"), katib.experiment_name("s", "fedavg_ft")}:
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name
    assert katib.experiment_name("mnist5k_tuning", "superfed_mm") == "mnist5k-tuning-superfed-mm"
    assert katib.trial_parameter_name("method.start_fraction") == "method_start_fraction"


def test_manifests():
    docs = katib.katib_manifests(STUDY_YAML, "mnist5k_tuning", SPACES, namespace=NAMESPACE, image=IMAGE, max_trials=12,
                                 parallel_trials=3, seed=1, algorithm="random")  # fmt: skip
    configmap, *experiments = docs
    assert configmap["kind"] == "ConfigMap" and yaml.safe_load(configmap["data"]["study.yaml"]) == yaml.safe_load(STUDY_YAML)
    assert [e["metadata"]["annotations"]["fedpipe.io/method"] for e in experiments] == list(SPACES)
    for e in experiments:
        assert e["metadata"]["namespace"] == configmap["metadata"]["namespace"] == NAMESPACE
        volumes = e["spec"]["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["volumes"]
        assert {"name": "study", "configMap": {"name": configmap["metadata"]["name"]}} in volumes
        assert experiment_problems(e) == []


@pytest.mark.parametrize("options, match", [
    ({"algorithm": "hyperband"}, "algorithm"),
    ({"parallel_trials": 30}, "parallel_trials"),
    ({"seed": -1}, "seed"),
    ({"objective_metric": "val.accuracy"}, "metric names"),
])  # fmt: skip
def test_bad_settings(options, match):
    with pytest.raises(ConfigError, match=match):
        experiment(**options)
