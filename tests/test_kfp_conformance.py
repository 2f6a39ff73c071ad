"""Every shipped pipeline, run through a model of the KFP backends users have (tests/kfp_backend.py):
the 2.5.0 launcher (Kubeflow 1.10.1 / 1.10.2: placeholders substituted in a random order) under many
orders and the 2.14+ one (Kubeflow 1.11, 26.03: `{{$}}` first). Every task must receive fully resolved
and identical inputs under both, and the driver must find every pod resource it reads. The study pipeline
(dsl.Collected) needs 2.14.0: under the 2.5.0 model it must fail (tests/test_study_pipeline.py has the rest).
The backends of 2026 (2.16.1, 2.17.0, whose driver resolves a container's placeholders itself, and 2.18.0,
read at master 7b70c7b since its tag is not in the snapshot) must give every task the same inputs."""

import random

import pytest
import yaml
from kfp import compiler, dsl
from kfp_backend import (
    COLLECTED,
    DRIVER_RESOLVES_ARGS,
    EXECUTOR_INPUT_FIRST,
    KNOWN_FIELDS,
    RANDOM_ORDER,
    BackendError,
    LoopRun,
    made_up_outputs,
    pb_value_to_string,
    resolve_container_args,
    run_pipeline,
    unknown_platform_fields,
    unresolved,
)

from fedpipe.algorithms import phases_of
from fedpipe.pipelines.builder import _QUANTITY, MIN_KFP_BACKEND, RESOURCE_PARAMETERS, SHIPPED, TASK_USER, DeployOptions
from fedpipe.pipelines.study import STUDY_MIN_KFP
from fedpipe.run.config import load_config

PIPELINES = sorted(p.name for p in SHIPPED.glob("*.yaml"))
ORDERS = 40  # random launcher orders per pipeline under 2.5.0; the old config task failed in ~97% of them
FLOORS = {"study.yaml": STUDY_MIN_KFP}  # the oldest backend each shipped pipeline runs on (default MIN_KFP_BACKEND)
# A method's pipeline branches on its config task's output, the run's engine.mode (dsl.If / dsl.Else): each branch is
# run through the model. The benchmark and the study have one branch (simulation).
CASES = [(n, m) for n in PIPELINES for m in (("simulation",) if n in ("benchmark.yaml", "study.yaml") else ("simulation", "federation"))]


def _base(task) -> str:
    """A task's own name (inside a condition's DAG its run name is `<branches>/<condition>/<task>`)."""
    return task.name.rsplit("/", 1)[-1]


def _mode_outputs(mode: str):
    """The model's made-up outputs, except the config task's: the run's engine.mode, which picks the branch."""

    def outputs(run_name: str, component: dict, parameters: dict) -> dict:
        made = made_up_outputs(run_name, component, parameters)
        return {**made, "Output": mode} if run_name.rsplit("/", 1)[-1].startswith("resolve-config") and "Output" in made else made

    return outputs


def _runs_on_2_5(name: str) -> bool:
    return FLOORS.get(name, MIN_KFP_BACKEND) == RANDOM_ORDER


def test_the_study_pipelines_floor_is_the_first_backend_with_collected():
    assert STUDY_MIN_KFP == COLLECTED and MIN_KFP_BACKEND == RANDOM_ORDER


def _load(path):
    spec, *platform = yaml.safe_load_all(path.read_text())
    return spec, platform[0] if platform else {}


def _changed_arguments(spec: dict) -> dict:
    """A value other than its default for every pipeline parameter: proves each one is wired through."""
    out = {}
    for name, p in spec["root"]["inputDefinitions"]["parameters"].items():
        default, kind = p.get("defaultValue"), p["parameterType"]
        if name in RESOURCE_PARAMETERS:
            out[name] = {"accelerator_type": "amd.com/gpu", "accelerator_count": "2"}.get(name, "3" if "cpu" in name else "5Gi")
        elif kind == "STRING":
            out[name] = f"{default}-changed"
        elif kind == "BOOLEAN":
            out[name] = not default
        elif kind == "NUMBER_INTEGER":
            out[name] = int(default) + 3
        elif kind == "NUMBER_DOUBLE":
            out[name] = float(default) + 0.25
        elif kind == "LIST":
            out[name] = [*default, "train.rounds=7"]
        elif kind == "STRUCT":
            out[name] = {"kubernetes.io/arch": "amd64"}
    return out


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_every_task_receives_resolved_identical_inputs_on_every_backend(name, mode):
    spec, _ = _load(SHIPPED / name)
    arguments = _changed_arguments(spec)
    outputs = _mode_outputs(mode)
    reference = run_pipeline(spec, arguments, EXECUTOR_INPUT_FIRST, random.Random(0), outputs)
    for task in reference.values():
        assert not unresolved(task.parameters), f"{name}: {task.name} receives placeholders under 2.14+: {unresolved(task.parameters)}"
    if not _runs_on_2_5(name):  # its floor is 2.14.0: the 2.5.0 driver cannot resolve dsl.Collected
        with pytest.raises(BackendError, match="dsl.Collected"):
            run_pipeline(spec, arguments, RANDOM_ORDER, random.Random(20))
        return
    rng = random.Random(20)
    for _ in range(ORDERS):
        runs = run_pipeline(spec, arguments, RANDOM_ORDER, rng, outputs)
        for task_name, task in runs.items():
            left = unresolved(task.parameters)
            assert not left, f"{name}: under KFP 2.5.0 task {task_name} receives literal placeholders: {left[:3]}"
            assert task.parameters == reference[task_name].parameters, f"{name}: {task_name} receives other inputs under 2.5.0 than 2.14+"
            assert task.resources == reference[task_name].resources


@pytest.mark.parametrize("name", PIPELINES)
def test_each_pipeline_parameter_reaches_its_task_and_every_pod_resource_resolves(name):
    spec, _ = _load(SHIPPED / name)
    arguments = _changed_arguments(spec)
    runs = run_pipeline(spec, arguments, RANDOM_ORDER if _runs_on_2_5(name) else EXECUTOR_INPUT_FIRST, random.Random(1))
    configs = [t for t in runs.values() if _base(t).startswith("resolve-config")]
    assert configs or name == "study.yaml"
    if name == "study.yaml":  # the study's one text reaches every task (each loop's tasks through the loop)
        tasks = [t for t in runs.values() if not isinstance(t, LoopRun)]
        assert len(tasks) > 4 and all(t.parameters["study_yaml"] == arguments["study_yaml"] for t in tasks)
    for task in configs:  # every config field the UI shows arrives under its own name, changed
        fields = task.parameters["defaults"]
        assert fields and all(task.parameters[dotted.replace(".", "_")] == arguments[dotted.replace(".", "_")] for dotted in fields)
        assert task.parameters["base_config"] == arguments["base_config"]
        assert task.parameters["overrides"] == arguments["overrides"]
    for task in runs.values():
        for field, value in task.resources.items():
            assert value and (field == "acceleratorType" or _QUANTITY.match(value)), f"{name}: {task.name} {field}={value!r}"
        if "acceleratorCount" in task.resources:
            assert task.resources["acceleratorCount"] == "2" and task.resources["acceleratorType"] == "amd.com/gpu"
            # the task is told what it asked for, so that a GPU it cannot use stops it (fedpipe.engine.devices)
            assert task.parameters["requested_accelerators"] == "2"
    compare = [t for t in runs.values() if _base(t) == "compare"]
    if name == "benchmark.yaml":  # the comparison gets each method's run id from that method's evaluate task
        (compare,) = compare
        evaluates = {t.name: t.outputs["Output"] for t in runs.values() if _base(t).startswith("evaluate")}
        assert sorted(compare.parameters[k] for k in compare.parameters if k.startswith("run_id_")) == sorted(evaluates.values())


@pytest.mark.parametrize("name", [n for n, m in CASES if m == "federation"])
def test_the_run_parameter_engine_mode_picks_the_branch_and_the_federation_asks_for_no_gpu(name):
    """A method's pipeline runs one branch per run, chosen by its config task's output (the run's engine.mode; the DAG
    driver evaluates the branch's trigger condition: 2.5.0 driver.go DAG, 2.17.0 dag.go). Simulation: partition,
    one training task per phase (each asking for the accelerator), evaluate, publish. Federation: the sites' census,
    one task per phase, evaluate, publish, none asking for a GPU (the sites train), each phase after the census and
    the previous phase."""
    spec, _ = _load(SHIPPED / name)
    arguments = _changed_arguments(spec)
    method = name.removesuffix(".yaml")
    phases = [p.name for p in phases_of(load_config(None, [f"method.name={method}"]).method, 30)]
    simulated = run_pipeline(spec, arguments, RANDOM_ORDER, random.Random(2), _mode_outputs("simulation"))
    federated = run_pipeline(spec, arguments, RANDOM_ORDER, random.Random(2), _mode_outputs("federation"))
    sim_names = sorted(_base(t) for t in simulated.values())
    fed_names = sorted(_base(t) for t in federated.values())
    assert not [n for n in sim_names if n.startswith("federated")] and "partition" in sim_names
    assert sum(n.startswith("train-phase") for n in sim_names) == len(phases)
    assert all("acceleratorCount" in t.resources for t in simulated.values() if _base(t).startswith("train-phase"))
    assert [n for n in fed_names if not n.startswith(("federated", "resolve-config", "publish"))] == []
    assert fed_names.count("federated-census") == 1 and fed_names.count("federated-evaluate") == 1
    assert sum(n.startswith("publish") for n in fed_names) == 1 and "publish" in sim_names  # the simulation's keeps its name
    runs = sorted((t for t in federated.values() if _base(t).startswith("federated-phase")), key=lambda t: len(t.upstream))
    assert [t.parameters["phase"] for t in runs] == phases
    assert not [t.name for t in federated.values() if "acceleratorCount" in t.resources]
    census = next(t for t in federated.values() if _base(t) == "federated-census")
    for earlier, later in zip(runs, runs[1:]):
        assert earlier.name in later.upstream and census.name in later.upstream
    assert runs[0].parameters["census"] == census.outputs["Output"]


def _dict_of_channels_pipeline(tmp_path):
    """The shape the config task had before: pipeline parameters inside a dict constant."""

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def take(fields: dict, single: int) -> str:
        return str(fields) + str(single)

    @dsl.pipeline(name="nested")
    def nested(train_rounds: int = 30, data_dataset: str = "mnist5k", seed: int = 0):
        take(fields={"train.rounds": train_rounds, "data.dataset": data_dataset, "run.seed": seed}, single=train_rounds)

    path = tmp_path / "nested.yaml"
    compiler.Compiler().compile(nested, str(path))
    return _load(path)[0]


def test_the_model_reproduces_the_pre_2_14_launcher_bug(tmp_path):
    """Pins the model against kubeflow/pipelines#11925 (launcher_v2_test.go, Test_compileCmdAndArgs): a dict
    of pipeline parameters resolves under 2.14+ (numbers as FormatFloat text) and stays literal in some
    random orders under 2.5.0; a top-level parameter resolves under both."""
    spec = _dict_of_channels_pipeline(tmp_path)
    fixed = run_pipeline(spec, {}, EXECUTOR_INPUT_FIRST, random.Random(0))["take"].parameters
    assert fixed == {"fields": {"train.rounds": "30", "data.dataset": "mnist5k", "run.seed": "0"}, "single": 30}
    rng = random.Random(0)
    outcomes = [run_pipeline(spec, {}, RANDOM_ORDER, rng)["take"].parameters for _ in range(40)]
    broken = [o for o in outcomes if unresolved(o)]
    assert broken and len(broken) < len(outcomes)  # at random: some orders work, some do not
    assert all(o["single"] == 30 for o in outcomes)
    assert "{{$.inputs.parameters['pipelinechannel--" in str(broken[0]["fields"])


def test_the_driver_refuses_a_parameter_of_the_wrong_kind(tmp_path):
    """driver.go handleParamTypeValidationAndConversion: a number input given a string fails the task,
    a string input given a number gets its text."""
    spec = _dict_of_channels_pipeline(tmp_path)
    with pytest.raises(BackendError, match="type mismatch: expect NUMBER_INTEGER, got STRING"):
        run_pipeline(spec, {"train_rounds": "30"}, EXECUTOR_INPUT_FIRST, random.Random(0))


@pytest.mark.parametrize("name", PIPELINES)
def test_every_backend_accepts_every_tasks_kubernetes_config_and_the_secret_is_fixed_at_compile_time(name):
    """The shipped pipelines are compiled for the floor (2.5.0): every API server from 2.5.0 to 2.16
    parses each task's Kubernetes config without an unknown field (which 2.14+ would refuse and 2.5.0
    answer by dropping the pod's labels, the NetworkPolicy's selector)."""
    spec, platform = _load(SHIPPED / name)
    assert "s3_secret" not in spec["root"]["inputDefinitions"]["parameters"]  # a UI user cannot point it at another Secret
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(spec["deploymentSpec"]["executors"])  # every task has its platform config
    for label, config in executors.items():
        for version in KNOWN_FIELDS:
            assert not unknown_platform_fields(config, version), f"{name} {label}: KFP {version} does not know {unknown_platform_fields(config, version)}"
        assert config["podMetadata"]["labels"]["app.kubernetes.io/part-of"] == "fedpipe"
        for secret in config["secretAsEnv"]:
            assert secret["secretNameParameter"] == {"runtimeValue": {"constant": DeployOptions().s3_secret}}, label


def test_a_pipeline_for_kfp_2_16_runs_every_task_as_the_images_user(tmp_path):
    """From 2.16.0 the driver applies a task's securityContext (backend/src/v2/driver/k8s.go,
    GetSecurityContext); the 2.5.0 driver has no such field, so the floor's pipeline leaves it out and
    the image's USER is what keeps a task off root there."""
    from fedpipe.pipelines.builder import compile_pipeline, method_pipeline
    from fedpipe.run.config import load_config

    cfg = load_config(None, ["method.name=fedavg"])
    path = compile_pipeline(method_pipeline(cfg, DeployOptions(kfp_version="2.16.0")), tmp_path / "p.yaml")
    executors = _load(path)[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for label, config in executors.items():
        context = config["securityContext"]  # int64 fields are strings in the proto's JSON
        assert (int(context["runAsUser"]), int(context["runAsGroup"]), context["runAsNonRoot"]) == (TASK_USER, TASK_USER, True), label
        assert not unknown_platform_fields(config, "2.16.0")
        assert unknown_platform_fields(config, "2.15.0") == ["securityContext"]  # why it is not the default


@pytest.mark.parametrize("kfp", ["2.5.0", "2.16.0"])
def test_the_charts_federation_pipeline_passes_every_backend_it_is_compiled_for(tmp_path, kfp):
    """What the chart registers with federation.enabled (`fedpipe register --federation-ca-secret ...
    --federation-superlink ... --federation-control-secret ...`): the federation tasks mount the CA-only Secret and the
    Control API's token Secret (secretAsVolume, named at compile time),
    and every backend from the pipeline's floor on knows each task's Kubernetes config and gives every task of both
    branches resolved, identical inputs."""
    from fedpipe.pipelines.builder import FEDERATION_CA_DIR, FEDERATION_CONTROL_DIR, compile_pipeline, method_pipeline

    options = DeployOptions(kfp_version=kfp, federation_ca_secret="federation-ca", federation_superlink="fedpipe-superlink-control:9091",
                            federation_control_secret="fedpipe-superlink-control-token")
    path = compile_pipeline(method_pipeline(load_config(None, ["method.name=superfed_mm"]), options), tmp_path / "p.yaml")
    spec, platform = _load(path)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    mounted = {label: config["secretAsVolume"] for label, config in executors.items() if "secretAsVolume" in config}
    assert mounted and all(label.startswith("exec-federated") for label in mounted), sorted(mounted)
    for volumes in mounted.values():
        assert sorted((v["secretNameParameter"]["runtimeValue"]["constant"], v["mountPath"]) for v in volumes) == [
            ("federation-ca", FEDERATION_CA_DIR), ("fedpipe-superlink-control-token", FEDERATION_CONTROL_DIR)]
    versions = [v for v in (*KNOWN_FIELDS, *NEWER) if tuple(map(int, v.split("."))) >= tuple(map(int, kfp.split(".")))]
    for label, config in executors.items():
        for version in versions:
            assert not unknown_platform_fields(config, version), f"{label}: KFP {version} does not know {unknown_platform_fields(config, version)}"
    arguments = _changed_arguments(spec)
    for mode in ("simulation", "federation"):
        reference = run_pipeline(spec, arguments, EXECUTOR_INPUT_FIRST, random.Random(0), _mode_outputs(mode))
        for version in [v for v in versions if v not in ("2.5.0", "2.14.0", "2.15.0", "2.16.0")]:
            runs = run_pipeline(spec, arguments, version, random.Random(0), _mode_outputs(mode))
            assert {n: t.parameters for n, t in runs.items()} == {n: t.parameters for n, t in reference.items()}
            assert all(not unresolved(t.parameters) for t in runs.values())
    assert unknown_platform_fields({"secretAsVolume": [{"secretName": "x", "mountPath": "/x", "readOnly": True}]}, "2.17.0") == [
        "secretAsVolume.readOnly"]


@pytest.mark.parametrize("version", ["2.4.1", "latest", ""])
def test_a_pipeline_cannot_be_compiled_for_a_backend_below_the_floor(version):
    from fedpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="--kfp-version"):
        DeployOptions(kfp_version=version)


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_a_pipeline_with_a_distributed_phase_resolves_on_every_backend(tmp_path, api):
    """`fedpipe register --distributed-phase` (the chart's pytorchJob.phase) compiles a launcher task in
    place of the phase's task: its inputs (the job's settings, storage, the pods' resources) must resolve
    the same way under both launchers."""
    from fedpipe.k8s.phasejob import PhaseJob
    from fedpipe.pipelines.builder import compile_pipeline, method_pipeline
    from fedpipe.run.config import load_config

    options = DeployOptions(distributed=(PhaseJob("personalization", nodes=2, api=api),), pushgateway="http://pgw:9091")
    path = compile_pipeline(method_pipeline(load_config(None, ["method.name=superfed_mm"]), options), tmp_path / "p.yaml")
    spec, _ = _load(path)
    arguments = _changed_arguments(spec)
    reference = run_pipeline(spec, arguments, EXECUTOR_INPUT_FIRST, random.Random(0))
    launcher = next(t for t in reference.values() if _base(t) == "launch-phase-job")
    assert launcher.parameters["cpu_limit"] == arguments["cpu_limit"] and launcher.parameters["job"]["api"] == api
    assert launcher.parameters["s3_secret"] == options.s3_secret
    rng = random.Random(3)
    for _ in range(ORDERS):
        for name, task in run_pipeline(spec, arguments, RANDOM_ORDER, rng).items():
            assert not unresolved(task.parameters) and task.parameters == reference[name].parameters, name


NEWER = ("2.16.1", "2.17.0", "2.18.0")  # Kubeflow 26.03.1's KFP, and the standalone releases of 2026


@pytest.mark.parametrize("version", NEWER)
@pytest.mark.parametrize(("name", "mode"), CASES)
def test_every_shipped_pipeline_runs_the_same_under_kfp_2_16_1_2_17_and_2_18(name, mode, version):
    """From 2.17.0 the driver resolves a container's input placeholders itself before the launcher
    (driver.go initPodSpecPatch -> util.go resolveContainerArgs, at the 2.17.0 tag; unchanged at master
    7b70c7b, which stands for 2.18.0 here: the tag is not in the snapshot read). A placeholder the driver
    cannot resolve fails the task, and its number text differs from the launcher's: every task of every
    shipped pipeline must receive exactly what it receives under 2.14-2.16, with the same pod resources,
    and its Kubernetes config must hold only fields that version's protos know."""
    spec, platform = _load(SHIPPED / name)
    arguments = _changed_arguments(spec)
    reference = run_pipeline(spec, arguments, EXECUTOR_INPUT_FIRST, random.Random(0), _mode_outputs(mode))
    runs = run_pipeline(spec, arguments, version, random.Random(0), _mode_outputs(mode))
    assert set(runs) == set(reference)
    for task_name, task in runs.items():
        assert not unresolved(task.parameters), f"{name}: {task_name} receives placeholders under {version}"
        assert task.parameters == reference[task_name].parameters, f"{name}: {task_name} receives other inputs under {version}"
        assert task.resources == reference[task_name].resources
    for label, config in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        assert not unknown_platform_fields(config, version), label


def _component_with_source(tmp_path, text: str):
    """A lightweight component whose embedded source (the container's command) holds `text`."""

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def echo(rounds: int, lr: float = 0.5) -> str:
        return "PLACEHOLDER"

    @dsl.pipeline(name="echo")
    def pipe(rounds: int = 3):
        echo(rounds=rounds)

    path = tmp_path / "echo.yaml"
    compiler.Compiler().compile(pipe, str(path))
    return yaml.safe_load(path.read_text().replace("PLACEHOLDER", text))


@pytest.mark.parametrize("version", ["2.16.1", "2.17.0"])
def test_the_2_17_driver_fails_a_task_whose_command_names_an_input_it_does_not_have(tmp_path, version):
    """resolveContainerArgs at 2.17.0 searches the whole command, a lightweight component's source
    included: placeholder text there of an input the driver's executor input lacks (an input left to
    its default: the launcher adds defaults later, launcher_v2.go addDefaultParams) fails the task.
    2.16.1's driver passes the command through, and the launcher leaves an unknown placeholder alone."""
    spec = _component_with_source(tmp_path, "{{$.inputs.parameters['lr']}}")
    if version == "2.16.1":
        assert run_pipeline(spec, {}, version, random.Random(0))["echo"].parameters == {"rounds": 3, "lr": 0.5}
        return
    assert DRIVER_RESOLVES_ARGS == version
    with pytest.raises(BackendError, match="parameter 'lr' not found in executor input"):
        run_pipeline(spec, {}, version, random.Random(0))
    # given explicitly, the same text is replaced inside the source, where the launcher would have left it
    spec = _component_with_source(tmp_path, "{{$.inputs.parameters['rounds']}}")
    command = spec["deploymentSpec"]["executors"]["exec-echo"]["container"]["command"]
    resolved = resolve_container_args(command, {"rounds": 3}, "echo")
    assert any('return "3"' in part for part in resolved) and not any("{{$.inputs" in part for part in resolved)


def test_the_2_17_driver_writes_numbers_and_optional_arguments_as_go_does():
    """util.go pbValueToString and resolveCondition at 2.17.0, pinned to util_test.go's cases
    (42 -> "42", 0.001 -> "0.001", IfPresent Then/Else) and to Go's %g (shortest digits, exponent form
    below 1e-4 or from 1e6 on: 1e-05, 1.2345675e+06), where the launcher writes FormatFloat 'f' (0.00001)."""
    assert [pb_value_to_string(v) for v in (42.0, 0.001, 1e-05, 1234567.5, True, None)] == ["42", "0.001", "1e-05", "1.2345675e+06", "true", ""]
    assert pb_value_to_string({"b": "<x>", "a": 1}) == '{"a":1,"b":"\\u003cx\\u003e"}'
    clause = '{"IfPresent": {"InputName": "lines", "Then": ["-n", "{{$.inputs.parameters[\'lines\']}}"], "Else": "--all"}}'
    assert resolve_container_args(["cat", clause, "{{$.outputs.parameters['out'].output_file}}"], {"lines": 1e-05}, "t") == [
        "cat", "-n", "1e-05", "{{$.outputs.parameters['out'].output_file}}"]
    assert resolve_container_args(["cat", clause], {"lines": None}, "t") == ["cat", "--all"]  # null counts as absent
    assert resolve_container_args(["x-{{$.inputs.parameters['a']}}-{{$.inputs.parameters['b']}}"], {"a": 1, "b": "y"}, "t") == ["x-1-y"]


@pytest.mark.parametrize("version", ["2.17.0", "2.18.0"])
def test_a_pipeline_compiled_for_kfp_2_17_and_2_18_holds_only_fields_they_know(tmp_path, version):
    """`fedpipe compile --kfp-version 2.17.0` (or 2.18.0): the task's securityContext of 2.16 and nothing
    the newer protos lack; initContainers (field 19 after 2.17.0) is not used, so 2.17 takes it too."""
    from fedpipe.pipelines.builder import compile_pipeline, method_pipeline
    from fedpipe.run.config import load_config

    path = compile_pipeline(method_pipeline(load_config(None, ["method.name=fedavg"]), DeployOptions(kfp_version=version)), tmp_path / "p.yaml")
    spec, platform = _load(path)
    for config in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        assert "securityContext" in config and not unknown_platform_fields(config, version) and not unknown_platform_fields(config, "2.17.0")
    assert unknown_platform_fields({"initContainers": []}, "2.17.0") == ["initContainers"]
    assert not unknown_platform_fields({"initContainers": []}, "2.18.0")
    runs = run_pipeline(spec, _changed_arguments(spec), version, random.Random(0))
    assert runs and all(not unresolved(t.parameters) for t in runs.values())
