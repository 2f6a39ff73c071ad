"""The Kubeflow pipelines: generated from the phase lists, shipped compiled and up to date, free of
credentials, and run end to end by kfp's local runner (every task in its own process)."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import yaml
from kfp_backend import flat_tasks
from runs import SMALL

import fedpipe.components
from fedpipe.algorithms import ALGORITHMS, phases_of
from fedpipe.pipelines.builder import (
    SHIPPED,
    DeployOptions,
    compile_pipeline,
    compile_shipped_components,
    method_pipeline,
    shipped_pipelines,
)
from fedpipe.run.config import load_config

COMPONENTS = os.path.dirname(fedpipe.components.__file__)


def root_tasks(spec: dict) -> dict:
    return flat_tasks(spec)  # the root DAG's tasks and those in its branches (engine_mode)


def test_shipped_pipelines_and_components_are_up_to_date(tmp_path):
    for name, pipeline in shipped_pipelines().items():
        compile_pipeline(pipeline, tmp_path / name)
        shipped = SHIPPED / name
        assert shipped.exists() and shipped.read_text() == (tmp_path / name).read_text(), (
            f"pipelines/{name} is out of date with the code: run `fedpipe compile --all` and commit the result"
        )
    for path in compile_shipped_components(tmp_path / "components"):
        shipped = os.path.join(COMPONENTS, path.name)
        assert open(shipped).read() == path.read_text(), f"components/{path.name} is out of date: run `fedpipe compile --all`"


def test_the_shipped_study_pipeline_is_up_to_date(tmp_path):
    """pipelines/study.yaml: examples/study_digits.yaml compiled for the release (pipelines/study.py)."""
    from fedpipe.pipelines.study import compile_shipped_study

    fresh = compile_shipped_study(tmp_path)
    assert (SHIPPED / "study.yaml").read_text() == fresh.read_text(), (
        "pipelines/study.yaml is out of date with the code: run `fedpipe compile --all` (or "
        "fedpipe.pipelines.study.compile_shipped_study()) and commit the result")


@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_one_task_per_phase_from_the_phase_list(method):
    spec = next(yaml.safe_load_all((SHIPPED / f"{method}.yaml").read_text()))
    tasks = root_tasks(spec)
    phases = [p.name for p in phases_of(load_config(None, [f"method.name={method}"]).method, 30)]
    training = [t for t in tasks.values() if t["componentRef"]["name"].startswith("comp-train-phase")]
    assert sorted(t["taskInfo"]["name"] for t in training) == sorted(phases)
    assert {t["taskInfo"]["name"] for t in tasks.values()} >= {"config", "partition", "evaluate"}
    # each phase after the first reads the state of the one before it
    for task in training:
        phase = task["inputs"]["parameters"]["phase"]["runtimeValue"]["constant"]
        previous = task["inputs"].get("artifacts", {}).get("previous")
        assert (previous is None) == (phase == phases[0])
    # the pipeline's parameters are the config's fields plus the training resources
    params = spec["root"]["inputDefinitions"]["parameters"]
    for name in ("train_rounds", "partition_num_clients", "run_seed", "accelerator_type", "accelerator_count", "node_selector", "tolerations"):
        assert name in params, name


def test_training_tasks_ask_for_the_gpu_and_pods_get_credentials_only_from_a_secret():
    spec_text = (SHIPPED / "superfed_mm.yaml").read_text()
    pipeline_spec, platform = list(yaml.safe_load_all(spec_text))
    executors = pipeline_spec["deploymentSpec"]["executors"]
    train = [e for name, e in executors.items() if "train-phase" in name]
    assert train and all(e["container"]["resources"]["accelerator"]["resourceCount"].startswith("{{$.inputs.parameters") for e in train)
    for name, executor in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        envs = {env["envVar"] for s in executor["secretAsEnv"] for env in s["keyToEnv"]}
        assert envs == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, name


def test_no_credential_in_any_compiled_pipeline(tmp_path, monkeypatch):
    secret, access = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY", "AKIAIOSFODNN7EXAMPLE"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", "http://minio.example:9000")
    texts = [p.read_text() for p in SHIPPED.glob("*.yaml")]
    for method in ("superfed_lm", "fedprox_ft"):
        cfg = load_config(None, [f"method.name={method}", "run.store=s3://bucket/prefix"])
        texts.append(compile_pipeline(method_pipeline(cfg, DeployOptions.from_env()), tmp_path / f"{method}.yaml").read_text())
    for text in texts:
        assert secret not in text and access not in text
        assert "AWS_SECRET_ACCESS_KEY:" not in text  # only ever as the name of an env var filled from the Secret


@pytest.mark.slow
def test_the_pipeline_runs_locally_with_one_task_per_phase(tmp_path):
    """README command 1's path: `fedpipe run` executes the shipped compiled pipeline with kfp's local runner."""
    args = [f"--set={s}" for s in [*SMALL, f"run.store={tmp_path}", "run.id=pipe", "method.name=superfed_mm",
                                   "train.rounds=2", "partition.num_clients=4"]]
    done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "run", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    for task in ("resolve-config", "partition", "train-phase", "train-phase-2", "evaluate"):
        assert f"Task '{task}' finished with status SUCCESS" in done.stderr, task
    assert "personalized accuracy" in done.stdout and "chosen lam" in done.stdout
    summary = json.loads((tmp_path / "pipe" / "report" / "summary.json").read_text())
    assert summary["method"] == "superfed_mm" and summary["num_clients"] == 4
    runs = list((tmp_path / "_kfp").iterdir())
    assert len(runs) == 1
    html = (runs[0] / "evaluate" / "report").read_text()
    assert html.startswith("<!doctype html>") and html.count("data:image/png;base64,") == 3
    # the phases' states stayed in the run's store: between tasks went a pointer naming the object and its hash
    for task, phase in (("train-phase", "federation"), ("train-phase-2", "personalization")):
        pointer = json.loads((runs[0] / task / "state").read_text())
        final = (tmp_path / "pipe" / "phases" / phase / "final.pt").read_bytes()
        assert pointer["key"] == f"pipe/phases/{phase}/final.pt" and pointer["size"] == len(final)
        assert pointer["sha256"] == hashlib.sha256(final).hexdigest() and (runs[0] / task / "state").stat().st_size < 1024


@pytest.mark.slow
def test_the_benchmark_pipeline_compares_methods_on_one_partition(tmp_path):
    args = [f"--set={s}" for s in [*SMALL, f"run.store={tmp_path}", "train.rounds=1", "partition.num_clients=3"]]
    done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "run", "--benchmark", "fedavg", "--benchmark", "local", *args],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout
    assert "| fedavg |" in table and "| local |" in table and "personalized acc." in table
    manifests = [json.loads(p.read_text()) for p in tmp_path.glob("*/partition/manifest.json")]
    assert len(manifests) == 3  # the shared partition, brought into each method's run unchanged
    assert all(m == manifests[0] for m in manifests)


def test_a_distributed_phase_is_a_pytorchjob_launcher_task(tmp_path):
    """`--distributed-phase`: that phase's task launches a PyTorchJob (fedpipe.k8s.pytorchjob);
    the other phases stay ordinary training tasks, and the chain of states is unchanged."""
    from fedpipe.errors import ConfigError
    from fedpipe.k8s.pytorchjob import PhaseJob
    from fedpipe.pipelines.builder import LAUNCHER_COMPONENT, benchmark_pipeline

    job = PhaseJob("personalization", nodes=3, processes_per_node=2, gpus_per_process=1)
    options = DeployOptions(distributed=(job,), pushgateway="http://pgw:9091")
    cfg = load_config(None, ["method.name=superfed_mm"])
    path = compile_pipeline(method_pipeline(cfg, options), tmp_path / "superfed_mm.yaml")
    spec, platform = list(yaml.safe_load_all(path.read_text()))
    tasks = root_tasks(spec)
    launchers = {n: t for n, t in tasks.items() if t["componentRef"]["name"] == "comp-launch-phase-job"}
    training = {n: t for n, t in tasks.items() if t["componentRef"]["name"].startswith("comp-train-phase")}
    assert [t["taskInfo"]["name"] for t in training.values()] == ["federation"]  # personalization's train task is gone
    ((name, launcher),) = launchers.items()
    assert launcher["taskInfo"]["name"] == "personalization (PyTorchJob)"
    params = launcher["inputs"]["parameters"]
    assert params["phase"]["runtimeValue"]["constant"] == "personalization"
    assert PhaseJob.from_dict(params["job"]["runtimeValue"]["constant"]) == job
    assert params["image"]["runtimeValue"]["constant"] == options.training_image
    storage = params["storage"]["runtimeValue"]["constant"]
    assert storage == {"s3_endpoint": options.s3_endpoint, "s3_secret_keys": ["accesskey", "secretkey"], "signing_secret": "",
                       "pushgateway": "http://pgw:9091", "extra_env": {}}
    # The training-resource parameters size each pod of the job; the Secret's name is fixed at compile time.
    for key in ("cpu_request", "cpu_limit", "memory_request", "memory_limit", "accelerator_type", "node_selector", "tolerations"):
        assert params[key] == {"componentInputParameter": key}, key
    assert params["s3_secret"] == {"runtimeValue": {"constant": options.s3_secret}}
    artifacts = launcher["inputs"]["artifacts"]
    assert artifacts["previous"]["taskOutputArtifact"] == {"outputArtifactKey": "state", "producerTask": next(iter(training))}
    assert tasks["evaluate"]["inputs"]["artifacts"]["state"]["taskOutputArtifact"]["producerTask"] == name
    executor = spec["deploymentSpec"]["executors"]["exec-launch-phase-job"]["container"]
    assert executor["image"] == options.image, "the launcher is the small CPU image; the job's pods get the CUDA one"
    assert "accelerator" not in executor["resources"]
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-launch-phase-job"]
    assert k8s["fieldPathAsEnv"] == [{"fieldPath": "metadata.namespace", "name": "FEDPIPE_NAMESPACE"}]
    assert k8s["podMetadata"]["labels"] == {"app.kubernetes.io/component": LAUNCHER_COMPONENT, "app.kubernetes.io/part-of": "fedpipe"}
    assert {e["envVar"] for s in k8s["secretAsEnv"] for e in s["keyToEnv"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # The benchmark distributes that phase in every method that has it.
    bench = compile_pipeline(benchmark_pipeline(cfg, ["superfed_mm", "fedavg"], options), tmp_path / "benchmark.yaml")
    text = bench.read_text()
    assert "superfed_mm personalization (PyTorchJob)" in text and "fedavg federation (PyTorchJob)" not in text
    with pytest.raises(ConfigError, match="not a phase of the pipeline's method"):
        method_pipeline(load_config(None, ["method.name=fedavg"]), options)


# --- resources, as Kubeflow's driver reads them ---------------------------------------------------------

def _driver_string(value) -> str:
    """Go's structpb `Value.GetStringValue()`: the string of a string value, "" for any other kind."""
    return value.string_value if value.WhichOneof("kind") == "string_value" else ""


def driver_resources(spec: dict, task_name: str, arguments: dict | None = None) -> dict:
    """The requests and limits KFP's driver gives a root task's pod (backend/src/v2/driver/driver.go,
    initPodSpecPatch): each resource placeholder is resolved from the executor input, whose parameter
    values are structpb Values of the pipeline parameter's type (a run's argument, else its default),
    read with GetStringValue (resolve.go, resolvePodSpecInputRuntimeParameter); an accelerator limit
    is set only when both its type and its count resolve to non-empty strings."""
    from google.protobuf import json_format, struct_pb2

    root_params = spec["root"]["inputDefinitions"]["parameters"]
    task = flat_tasks(spec)[task_name]
    executor = spec["components"][task["componentRef"]["name"]]["executorLabel"]
    resources = spec["deploymentSpec"]["executors"][executor]["container"].get("resources", {})

    def resolve(placeholder: str) -> str:
        if not placeholder.startswith("{{$.inputs.parameters['"):
            return placeholder
        channel = placeholder.split("'")[1]
        root_name = task["inputs"]["parameters"][channel]["componentInputParameter"]
        kind = root_params[root_name]["parameterType"]
        raw = (arguments or {}).get(root_name, root_params[root_name].get("defaultValue"))
        if kind == "STRING":
            raw = str(raw)  # the API server stores a STRING parameter's argument as a string value
        return _driver_string(json_format.ParseDict(raw, struct_pb2.Value()))

    out = {"requests": {}, "limits": {}}
    for field, side, name in (("resourceCpuRequest", "requests", "cpu"), ("resourceCpuLimit", "limits", "cpu"),
                              ("resourceMemoryRequest", "requests", "memory"), ("resourceMemoryLimit", "limits", "memory")):
        if resources.get(field):
            out[side][name] = resolve(resources[field])
    accelerator = resources.get("accelerator", {})
    kind, count = resolve(accelerator.get("resourceType", "")), resolve(accelerator.get("resourceCount", ""))
    if kind and count:
        out["limits"][kind] = count
    return out


@pytest.mark.parametrize("method", ["superfed_mm", "fedavg", "fedmoe"])
def test_training_tasks_request_one_gpu_by_default_as_the_driver_reads_it(method):
    spec = next(yaml.safe_load_all((SHIPPED / f"{method}.yaml").read_text()))
    tasks = root_tasks(spec)
    training = [n for n, t in tasks.items() if t["componentRef"]["name"].startswith("comp-train-phase")]
    assert training
    for name in training:
        got = driver_resources(spec, name)
        assert got["limits"].get("nvidia.com/gpu") == "1", (name, got)
        assert got["requests"] == {"cpu": "1", "memory": "2Gi"} and got["limits"]["memory"] == "16Gi"
        # a CPU-only run, from the UI: accelerator_count "0" (a limit of 0 GPUs asks for none)
        assert driver_resources(spec, name, {"accelerator_count": "0"})["limits"]["nvidia.com/gpu"] == "0"
        assert driver_resources(spec, name, {"accelerator_count": "2"})["limits"]["nvidia.com/gpu"] == "2"
    # every other task has requests and limits too, and never a GPU
    for name in set(tasks) - set(training):
        got = driver_resources(spec, name)
        assert got == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}, (name, got)


def test_an_int_accelerator_count_would_give_no_gpu():
    """Why the count is a string parameter: the driver reads an int parameter's value as "" (no limit)."""
    spec = next(yaml.safe_load_all((SHIPPED / "fedavg.yaml").read_text()))
    spec["root"]["inputDefinitions"]["parameters"]["accelerator_count"] = {"defaultValue": 1.0, "parameterType": "NUMBER_INTEGER"}
    train = next(n for n, t in root_tasks(spec).items() if t["componentRef"]["name"].startswith("comp-train-phase"))
    assert "nvidia.com/gpu" not in driver_resources(spec, train)["limits"]


def test_compile_flags_set_images_gpu_resources_and_pushgateway(tmp_path):
    out = tmp_path / "p.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", "compile", "--set", "method.name=fedavg", "-o", str(out),
         "--image-repository", "127.0.0.1:5000/fedpipe/fedpipe", "--image-tag", "dev", "--training-image-tag", "dev-gpu",
         "--accelerator-count", "0", "--resource", "memory_limit=32Gi", "--resource", "step_cpu_request=250m",
         "--pushgateway", "http://pgw.monitoring:9091"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    spec, platform = list(yaml.safe_load_all(out.read_text()))
    images = {name: e["container"]["image"] for name, e in spec["deploymentSpec"]["executors"].items()}
    assert images.pop("exec-train-phase") == "127.0.0.1:5000/fedpipe/fedpipe:dev-gpu"
    assert set(images.values()) == {"127.0.0.1:5000/fedpipe/fedpipe:dev"}
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["accelerator_count"] == {"defaultValue": "0", "isOptional": True, "parameterType": "STRING"}
    assert params["memory_limit"]["defaultValue"] == "32Gi" and params["step_cpu_request"]["defaultValue"] == "250m"
    # the Pushgateway is a run parameter (the UI can change it), not a fixed env var of the pods
    assert params["telemetry_pushgateway"] == {"defaultValue": "http://pgw.monitoring:9091", "isOptional": True, "parameterType": "STRING"}
    assert "FEDPIPE_PUSHGATEWAY" not in out.read_text()
    # every task pod carries the label the chart's NetworkPolicy selects
    for name, executor in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        assert executor["podMetadata"]["labels"]["app.kubernetes.io/part-of"] == "fedpipe", name


@pytest.mark.parametrize("flags, message", [
    (["--resource", "memory_limit=lots"], "not a Kubernetes quantity"),
    (["--resource", "gpu_count=2"], "unknown resource gpu_count"),
    (["--resource", "memory_limit"], "is not NAME=VALUE"),
    (["--accelerator-type", "gpu"], "extended resource name"),
    (["--image-tag", "a:b"], "--image-tag 'a:b' is not valid"),
])
def test_bad_deploy_flags_are_plain_errors(tmp_path, flags, message):
    done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "compile", "-o", str(tmp_path / "p.yaml"), *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "p.yaml").exists()


def test_a_base_config_pasted_in_the_ui_keeps_the_deployments_store_and_pushgateway(tmp_path):
    """resolve_config: a field the base config leaves out (or null) takes the pipeline parameter's value,
    a field it sets is kept unless the run changed the parameter."""
    from fedpipe.components.bodies import resolve_config

    defaults = {"run.store": "s3://mlpipeline/fedpipe", "telemetry.pushgateway": "http://pgw:9091", "train.rounds": 30}
    base = "method: {name: fedavg}\ntelemetry: {pushgateway: null}\n"
    cfg = resolve_config(base, dict(defaults), defaults, [], "job1", str(tmp_path / "a.yaml"))
    assert (cfg.run.store, cfg.telemetry.pushgateway, cfg.train.rounds) == ("s3://mlpipeline/fedpipe", "http://pgw:9091", 30)
    own = "run: {store: s3://mine/runs}\ntelemetry: {pushgateway: http://other:9091}\ntrain: {rounds: 3}\n"
    cfg = resolve_config(own, dict(defaults), defaults, [], "job1", str(tmp_path / "b.yaml"))
    assert (cfg.run.store, cfg.telemetry.pushgateway, cfg.train.rounds) == ("s3://mine/runs", "http://other:9091", 3)
    changed = {**defaults, "telemetry.pushgateway": "http://ui:9091"}
    cfg = resolve_config(own, changed, defaults, [], "job1", str(tmp_path / "c.yaml"))
    assert cfg.telemetry.pushgateway == "http://ui:9091"


def test_the_config_task_refuses_a_federated_run_that_would_fail_after_its_training(tmp_path):
    """A run started from the UI in federation mode whose gate metric the federated publication refuses (it registers
    the global model only) fails at the config task, by name, before any site trains
    (fedpipe.models.federated.check_federated); a private warm start passes it (the federation continues the version's
    ledger)."""
    from fedpipe.components.bodies import resolve_config
    from fedpipe.errors import ConfigError, StoreError

    base = f"method: {{name: fedavg}}\nengine: {{mode: federation}}\nfederation: {{sites: 3}}\nrun: {{store: {tmp_path / 'store'}}}\n"
    ok = resolve_config(base, {}, {}, ["registry.name=line", "registry.gate_metric=global_accuracy"], "job", str(tmp_path / "ok.yaml"))
    assert ok.engine.mode == "federation" and ok.registry.gate_metric == "global_accuracy"
    with pytest.raises(ConfigError, match="registry.gate_metric=personalized_accuracy: a federated run registers its global model only"):
        resolve_config(base, {}, {}, ["registry.name=line", "registry.gate_metric=personalized_accuracy"], "job", str(tmp_path / "a.yaml"))
    with pytest.raises(StoreError, match="has no version 3"):  # read as a plain warm start's version is
        resolve_config(base, {}, {}, ["registry.name=line", "registry.gate_metric=global_accuracy", "train.init_from=3",
                                      "privacy.enabled=true"], "job", str(tmp_path / "b.yaml"))


def test_an_unset_flag_keeps_the_environments_deployment_value(monkeypatch):
    """The chart's registration Job passes the store's endpoint and Secret as env (FEDPIPE_S3_ENDPOINT,
    FEDPIPE_S3_SECRET) and leaves the flags unset: their None must not hide the env."""
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", "http://seaweedfs.kubeflow:8333")
    monkeypatch.setenv("FEDPIPE_S3_SECRET", "team-s3")
    options = DeployOptions.from_env(s3_endpoint=None, s3_secret=None, pushgateway="http://pgw:9091")
    assert (options.s3_endpoint, options.s3_secret, options.pushgateway) == ("http://seaweedfs.kubeflow:8333", "team-s3", "http://pgw:9091")
    assert DeployOptions.from_env(s3_secret="flag-wins").s3_secret == "flag-wins"


def test_the_task_check_keeps_kfps_behaviour_without_its_stack_walk():
    """pipelines/builder.py replaces kfp's `PipelineTask._ensure_container_spec_exists` (an `inspect.stack()` per resource
    setter: minutes of the suite's time) by the same check: a task without a container spec still refuses, naming the
    setter, and a container task takes the setting."""
    from kfp import dsl
    from kfp.dsl.pipeline_task import TaskState

    from fedpipe.pipelines.builder import _ensure_container_spec_exists

    assert dsl.PipelineTask._ensure_container_spec_exists is _ensure_container_spec_exists
    task = dsl.PipelineTask.__new__(dsl.PipelineTask)
    task.container_spec, task.state = None, TaskState.FUTURE
    with pytest.raises(ValueError, match="^set_cpu_limit can only be used on single-step components"):
        task.set_cpu_limit("1")
