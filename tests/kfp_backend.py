"""A conformance model of the Kubeflow Pipelines v2 backend's parameter path, for tests only.

The local runner fills a task's inputs in Python and never shows what a cluster's backend does with a
compiled pipeline. This model re-implements, version by version, the three steps a task's parameters go
through on a cluster, each rule from the Go (or Python) source it cites (kubeflow/pipelines at the tag):

1. **driver** (backend/src/v2/driver/driver.go at 2.5.0, ``resolveInputs`` / ``resolveInputParameter``;
   the same rules moved to resolve.go by 2.14.0): every input of the *task* (not only the component's
   declared ones) is resolved: ``componentInputParameter`` from the parent DAG, ``taskOutputParameter``
   from the producer, ``runtimeValue.constant`` as it is, except a string that is exactly one of the
   job placeholders (``{{$.pipeline_job_uuid}}``, ...). A constant struct or list is *not* searched for
   placeholders. Then ``handleParamTypeValidationAndConversion``: a STRING input given another kind is
   turned into text (metadata/converter.go ``PbValueToText``), any other declared type given another
   kind is an error. Pod resources and the accelerator come from the executor input's *string* value
   of the parameter the field names (``resolvePodSpecInputRuntimeParameter``, ``getPodResource``).
2. **launcher** (backend/src/v2/component/launcher_v2.go, ``executeV2``): defaults are added
   (``addDefaultParams``), then the placeholders of ``getPlaceholders`` are replaced in the command and
   each argument. Up to 2.13 ``{{$}}`` (the executor input as JSON) is one entry of that Go map, and
   Go's map iteration order is random: a placeholder visited before ``{{$}}`` is not replaced inside
   the JSON that ``{{$}}`` later brings in. From 2.14.0 (kubeflow/pipelines#11925, commit 3337b5e,
   ``compileCmdAndArgs``) ``{{$}}`` is replaced first, then the others, inside the JSON text too.
   Values are raw text: strings as they are, numbers as ``strconv.FormatFloat(v, 'f', -1, 64)``, bools
   as ``true``/``false``, lists and structs as JSON.
3. **kfp executor** (sdk python/kfp/dsl/executor.py, ``Executor.execute``, in the task's container):
   parses ``--executor_input`` as JSON and hands the function each parameter its signature names from
   ``inputs.parameterValues``.

2a. **driver, from 2.17.0** (backend/src/v2/driver/driver.go ``initPodSpecPatch`` calls util.go
   ``resolveContainerArgs`` on the command and the arguments, kubeflow/pipelines#12598): before the
   launcher runs, every ``{{$.inputs.parameters['x']}}`` in a command or argument that does not mention
   ``$.outputs`` is replaced with ``pbValueToString`` of the *driver's* executor input (no defaults yet:
   the launcher adds them), and an ``{"IfPresent": ...}`` clause is expanded. A placeholder of a parameter
   the driver's executor input lacks fails the task ("parameter ... not found in executor input"); numbers
   are ``%d`` when whole, else Go's ``%g`` (1e-05, not the launcher's 0.00001). ``{{$}}`` is not such a
   placeholder and is still the launcher's. Unchanged at master 7b70c7b (2026-08-21, 160 commits after
   2.17.0), the newest source in reach: the 2.18.0 tag itself is not (see KFP_2_18_SOURCE).

4. **loops and dsl.Collected** (driver.go at 2.5.0: ``DAG``, ``resolveInputs``, ``getDAGTasks``,
   ``resolveUpstreamParameters``; at 2.14.0 resolve.go: the same plus ``CollectInputs``; the Argo side in
   backend/src/v2/compiler/argocompiler/dag.go, ``iteratorTask``): see ``_run_loop`` and ``_collected``.

It is a model, not KFP: no Argo, no MLMD, no artifacts' bytes. It answers one question per task: what
does the component's function receive, and what does the driver put in the pod's resources.
"""

from __future__ import annotations

import json
import random
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np

# Backend versions whose launcher differs: up to 2.13.x one random-order pass, from 2.14.0 {{$}} first.
RANDOM_ORDER = "2.5.0"
EXECUTOR_INPUT_FIRST = "2.14.0"
# The first backend whose driver resolves a ParallelFor's outputs for a task after the loop (dsl.Collected):
# kubeflow/pipelines#11725 "enable dsl.Collected for parameters & artifacts", commit ed828b5, first tagged 2.14.0.
COLLECTED = "2.14.0"
# The first backend whose driver resolves input placeholders in a container's command and arguments itself
# (driver.go initPodSpecPatch -> util.go resolveContainerArgs; not at 2.16.1, first tagged 2.17.0).
DRIVER_RESOLVES_ARGS = "2.17.0"
# What "2.18.0" stands for in this model: kubeflow/pipelines master at this commit (2026-08-21), 160
# commits after the 2.17.0 tag; the 2.18.0 tag is not in the snapshot read here, so its rules are those
# of this commit (driver, launcher and API server unchanged for the parameter path since 2.17.0; the
# Kubernetes config gained init_containers, field 19).
KFP_2_18_SOURCE = "7b70c7b95f"
# Every backend version the model runs, oldest first (2.16.1: Kubeflow 26.03.1; 2.17.0, 2.18.0: standalone).
VERSIONS = ("2.5.0", "2.14.0", "2.15.0", "2.16.0", "2.16.1", "2.17.0", "2.18.0")
# KFP 2.17's MLflow plugin (backend/src/v2/common/plugins/mlflow/handler.go, RetrieveUserContainerEnvVars at
# 2.17.0): what the driver adds to every user container when the API server has MLflow configured and
# injectUserEnvVars is on. MLFLOW_RUN_ID is the task's nested run (OnTaskStart: CreateRun in the experiment,
# tagged mlflow.parentRunId = the pipeline run's parent run); the launcher ends it (OnTaskEnd: LogBatch of
# the task's input parameters as JSON text and its Metrics artifacts' scalars, then UpdateRun with the
# terminal status).
MLFLOW_PLUGIN_ENV = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")
MLFLOW_PARENT_TAG = "mlflow.parentRunId"  # backend/src/common/plugins/mlflow/client.go ParentRunTagKey

JOB_PLACEHOLDERS = {  # driver: resolveInputParameter, RuntimeValue constants replaced whole
    "{{$.pipeline_job_name}}": "fedpipe-run-display-name",
    "{{$.pipeline_job_resource_name}}": "fedpipe-run-abc12",
    "{{$.pipeline_job_uuid}}": "0b5e7d1e-6b8f-4c9f-9d3e-5f2a1c0d4e6f",
    "{{$.pipeline_task_name}}": "task-name",
    "{{$.pipeline_task_uuid}}": "4242",
}
PARAMETER_KINDS = {  # pipeline spec parameterType -> the Python types a protobuf Value of that kind parses to
    "STRING": (str,), "NUMBER_INTEGER": (int, float), "NUMBER_DOUBLE": (int, float), "BOOLEAN": (bool,),
    "LIST": (list,), "STRUCT": (dict,),
}


class BackendError(Exception):
    """What the driver or launcher would fail the task with."""


def _kind(value) -> str:
    if isinstance(value, bool):
        return "BOOLEAN"
    if isinstance(value, (int, float)):
        return "NUMBER"
    return {str: "STRING", list: "LIST", dict: "STRUCT", type(None): "NULL"}[type(value)]


def value_text(value) -> str:
    """metadata/converter.go PbValueToText and launcher_v2.go getPlaceholders: a Value as raw text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return np.format_float_positional(float(value), trim="-")  # FormatFloat(v, 'f', -1, 64)
    return json.dumps(value, separators=(",", ":"))


@dataclass
class TaskRun:
    """What one task received under one backend version."""

    name: str
    parameters: dict  # what the component's function is called with (its declared input parameters)
    resources: dict = field(default_factory=dict)  # pod resources the driver resolved (cpu_limit, accelerator_count, ...)
    outputs: dict = field(default_factory=dict)  # its output parameters (made-up values downstream tasks receive)
    upstream: frozenset = frozenset()  # every task run that Argo finishes before this one starts


@dataclass
class LoopRun(TaskRun):
    """A ParallelFor (a task with a parameterIterator): `parameters` are its resolved inputs, `items` what it
    iterates over, `parallelism` the limit Argo's loop template gets (None: unlimited)."""

    items: list = field(default_factory=list)
    parallelism: int | None = None
    iterations: list = field(default_factory=list)  # per iteration: {inner task name: its outputs}
    dag_outputs: dict = field(default_factory=dict)  # the loop component's dag.outputs.parameters


def _version(tag: str) -> tuple[int, ...]:
    return tuple(int(x) for x in tag.split("."))


def _resolve_task_inputs(task: dict, component: dict, dag_inputs: dict, produced: dict, name: str, version: str,
                         skip: tuple = ()) -> dict:
    """driver.go resolveInputs: every task input, then the declared ones type-checked and converted
    (`skip`: the loop's item input, which the loop's own driver does not have yet)."""
    values = {}
    for key, spec in task.get("inputs", {}).get("parameters", {}).items():
        if "componentInputParameter" in spec:
            source = spec["componentInputParameter"]
            if source not in dag_inputs:
                raise BackendError(f"{name}: parent DAG does not have input parameter {source}")
            values[key] = dag_inputs[source]
        elif "taskOutputParameter" in spec:
            out = spec["taskOutputParameter"]
            producer = produced[out["producerTask"]]
            if isinstance(producer, LoopRun):
                values[key] = _collected(producer, out["outputParameterKey"], version, name)
            else:
                values[key] = producer[out["outputParameterKey"]]
        elif "runtimeValue" in spec:
            constant = spec["runtimeValue"]["constant"]
            values[key] = JOB_PLACEHOLDERS.get(constant, constant) if isinstance(constant, str) else constant
        else:
            raise BackendError(f"{name}: input {key} has a kind the model does not know: {sorted(spec)}")
    return _validate_and_convert(values, component, name, skip)


def _validate_and_convert(values: dict, component: dict, name: str, skip: tuple = ()) -> dict:
    """driver.go resolveInputs' handleParamTypeValidationAndConversion, over the *component's* declared
    inputs (for a loop's driver and each iteration's: the loop's DAG component): a STRING input given
    another kind becomes its text (metadata/converter.go PbValueToText), any other type must match."""
    declared = component.get("inputDefinitions", {}).get("parameters", {})
    for key, spec in declared.items():
        if key in skip:
            continue
        if key not in values:
            if "defaultValue" not in spec and not spec.get("isOptional"):
                raise BackendError(f"{name}: neither value nor default value provided for non-optional parameter {key!r}")
            continue
        wanted, value = spec["parameterType"], values[key]
        if wanted == "STRING" and not isinstance(value, str):
            values[key] = value_text(value)
        elif wanted != "STRING" and not isinstance(value, PARAMETER_KINDS[wanted]) or (
                wanted.startswith("NUMBER") and isinstance(value, bool)):
            raise BackendError(f"{name}: input parameter {key!r} type mismatch: expect {wanted}, got {_kind(value)}")
    return values


def _items(value, name: str) -> list:
    """driver.go getItems: a list value, or a string holding a JSON list; anything else cannot be iterated."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise BackendError(f"{name}: iterating on item input failed: {e}") from None
        if isinstance(parsed, list):
            return parsed
        return []  # structpb: GetListValue() of a non-list is nil, so no items
    raise BackendError(f"{name}: iterating on item input failed: value of type {_kind(value)} cannot be iterated")


def _collected(loop: LoopRun, key: str, version: str, name: str) -> list:
    """What a task after a ParallelFor receives for a loop output (dsl.Collected, compiled as the loop DAG's
    output parameter `key` with valueFromParameter {producerSubtask, outputParameterKey}).

    2.5.0 (driver.go, resolveUpstreamParameters): getDAGTasks skips a DAG execution that has an
    "iteration_count" ("Found a ParallelFor task ... Skipping it"), so the loop's inner tasks are not in the
    task map: the producer subtask is not found and the task fails ("subTaskName, ..., not in tasks").
    2.14.0 on (resolve.go, resolveUpstreamParameters -> getParallelForIterationCount -> CollectInputs): with
    iteration_count > 0 the value is a list of the producer subtask's output in each iteration, in
    iteration order (the BFS queue holds iterations 0..n-1); with 0 iterations it does not collect but
    falls through to GetProducerTask and fails the same way as 2.5.0."""
    spec = loop.dag_outputs.get(key, {})
    if "valueFromParameter" not in spec:
        raise BackendError(f"{name}: loop output {key} is not a valueFromParameter (not in this model)")
    subtask, inner_key = spec["valueFromParameter"]["producerSubtask"], spec["valueFromParameter"]["outputParameterKey"]
    if _version(version) < _version(COLLECTED):
        raise BackendError(f"{name}: KFP {version} cannot resolve {key} of ParallelFor {loop.name} (dsl.Collected): "
                           f"getDAGTasks skips the loop's DAG, so subTaskName, {subtask}, not in tasks (needs KFP {COLLECTED}+)")
    if not loop.iterations:
        raise BackendError(f"{name}: ParallelFor {loop.name} had no iteration: nothing to collect, subTaskName, {subtask}, not in tasks")
    if any(isinstance(it[subtask], LoopRun) for it in loop.iterations):
        raise BackendError(f"{name}: collecting from nested loops is not in this model")
    return [it[subtask][inner_key] for it in loop.iterations]


def go_g(number: float) -> str:
    """Go's fmt.Sprintf("%g", n): the shortest digits that round-trip, in exponent form when the exponent is
    below -4 or at least 6 (strconv/ftoa.go: shortest sets eprec = 6), with a two-digit exponent."""
    text = repr(float(number))
    sign = "-" if text.startswith("-") else ""
    _, digits, exp = Decimal(text.lstrip("-")).normalize().as_tuple()
    x = len(digits) + exp - 1  # the decimal exponent of the first digit
    if x < -4 or x >= 6:
        mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
        return f"{sign}{mantissa}e{'-' if x < 0 else '+'}{abs(x):02d}"
    return sign + format(Decimal(text.lstrip("-")), "f")


def pb_value_to_string(value) -> str:
    """driver/util.go pbValueToString (2.17.0): a whole number as %d, another as %g, lists and structs as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        whole = float(value) == int(value) and abs(value) < 2**63  # float64(int64(n)) == n
        return str(int(value)) if whole else go_g(value)
    return go_json(value)


def go_json(value) -> str:
    """encoding/json Marshal: compact, map keys sorted, UTF-8 kept, and <, >, &, U+2028, U+2029 escaped."""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


FULL_INPUT_PARAMETER = re.compile(r"\{\{\$\.inputs\.parameters\['(.+?)']}}")  # util.go fullInputParameterRe


def _driver_substitute(arg: str, values: dict, name: str) -> str:
    """util.go resolveInputParameterPlaceholders: every full placeholder of an input parameter, or an error."""
    def one(match: re.Match) -> str:
        if match.group(1) not in values:
            raise BackendError(f"{name}: failed to resolve input parameters: parameter {match.group(1)!r} not found in executor input")
        return pb_value_to_string(values[match.group(1)])
    return FULL_INPUT_PARAMETER.sub(one, arg)


def resolve_container_args(args: list[str], values: dict, name: str) -> list[str]:
    """util.go resolveContainerArgs (2.17.0+): what the driver makes of a command or argument list before the
    launcher; `values` is the driver's executor input (the task's resolved inputs, without defaults)."""
    out = []
    for arg in args:
        if "$.outputs" in arg:  # left to Argo / the launcher
            out.append(arg)
        elif arg.strip().startswith('{"IfPresent":'):  # isConditionClause / resolveCondition
            clause = json.loads(arg)["IfPresent"]
            present = values.get(clause["InputName"]) is not None  # a null value counts as absent
            chosen = clause.get("Then") if present else clause.get("Else")
            chosen = [] if chosen is None else [chosen] if isinstance(chosen, str) else chosen
            out += [_driver_substitute(item, values, name) for item in chosen]
        else:
            out.append(_driver_substitute(arg, values, name))
    return out


def _executor_input(values: dict, component: dict) -> dict:
    """launcher_v2.go addDefaultParams: the declared defaults of inputs that were not given."""
    with_defaults = dict(values)
    for key, spec in component.get("inputDefinitions", {}).get("parameters", {}).items():
        if key not in with_defaults and "defaultValue" in spec:
            with_defaults[key] = spec["defaultValue"]
    outputs = {k: {"outputFile": f"/tmp/outputs/{k}"} for k in component.get("outputDefinitions", {}).get("parameters", {})}
    return {"inputs": {"parameterValues": with_defaults}, "outputs": {"parameters": outputs, "outputFile": "/tmp/kfp_outputs/output_metadata.json"}}


def _placeholders(executor_input: dict) -> dict[str, str]:
    """launcher_v2.go getPlaceholders (parameters; artifacts' URIs and paths play no part in this model)."""
    table = {"{{$}}": json.dumps(executor_input, separators=(",", ":"))}
    for key, value in executor_input["inputs"]["parameterValues"].items():
        table[f"{{{{$.inputs.parameters['{key}']}}}}"] = value_text(value)
    for key, spec in executor_input["outputs"]["parameters"].items():
        table[f"{{{{$.outputs.parameters['{key}'].output_file}}}}"] = spec["outputFile"]
    return table


def substitute(args: list[str], executor_input: dict, version: str, rng: random.Random) -> list[str]:
    """The launcher's substitution of the container's arguments, as `version` does it."""
    table = _placeholders(executor_input)
    out = []
    for arg in args:
        if version == RANDOM_ORDER:  # one `range` over the Go map per argument, each in its own random order
            order = list(table.items())
            rng.shuffle(order)
        else:  # compileCmdAndArgs: {{$}} first, then the rest (in any order: none contains another)
            order = [("{{$}}", table["{{$}}"])] + [(k, v) for k, v in table.items() if k != "{{$}}"]
        for placeholder, replacement in order:
            arg = arg.replace(placeholder, replacement)
        out.append(arg)
    return out


def _received(args: list[str], component: dict, name: str) -> dict:
    """kfp/dsl/executor.py: the function's parameters from the --executor_input JSON."""
    if "--executor_input" not in args:
        raise BackendError(f"{name}: not a lightweight Python component (no --executor_input): {shlex.join(args)[:200]}")
    text = args[args.index("--executor_input") + 1]
    try:
        executor_input = json.loads(text)
    except ValueError as e:
        raise BackendError(f"{name}: the executor input is not JSON after substitution ({e}): a raw value broke it") from None
    values = executor_input["inputs"]["parameterValues"]
    return {k: values.get(k) for k in component.get("inputDefinitions", {}).get("parameters", {})}


CHANNEL = re.compile(r"\$.inputs.parameters\['(.+?)'\]")  # util.go inputPipelineChannelPattern, unanchored
RESOURCE_FIELDS = ("resourceCpuLimit", "resourceCpuRequest", "resourceMemoryLimit", "resourceMemoryRequest")


def _pod_resources(container: dict, executor_input: dict) -> dict:
    """driver.go initPodSpecPatch / getPodResource / resolvePodSpecInputRuntimeParameter: a field that is
    `{{$.inputs.parameters['pipelinechannel--x']}}` takes the *string* value of that input."""
    values = executor_input["inputs"]["parameterValues"]

    def resolve(text: str) -> str:
        match = CHANNEL.search(text)  # util.go isInputParameterChannel / extractInputParameterFromChannel
        if match is None:
            return text
        if match.group(1) not in values:
            raise BackendError(f"executorInput did not contain the parameter of {text}")
        value = values[match.group(1)]
        return value if isinstance(value, str) else ""  # Value.GetStringValue(): "" for a number

    resources = container.get("resources", {})
    out = {f: resolve(resources[f]) for f in RESOURCE_FIELDS if f in resources}
    accelerator = resources.get("accelerator", {})
    if "resourceType" in accelerator:
        out["acceleratorType"] = resolve(accelerator["resourceType"])
    if "resourceCount" in accelerator:
        out["acceleratorCount"] = resolve(accelerator["resourceCount"])
    return out


def _needs(task: dict) -> set[str]:
    """The tasks of the same DAG that must finish first: dependentTasks (the compiler adds every producer:
    argocompiler/dag.go addImplicitDependencies; Argo `depends` on each, iteratorTask too) and producers."""
    needs = set(task.get("dependentTasks", []))
    for kind in ("parameters", "artifacts"):
        for spec in task.get("inputs", {}).get(kind, {}).values():
            for key in ("taskOutputParameter", "taskOutputArtifact"):
                if key in spec:
                    needs.add(spec[key]["producerTask"])
    return needs


def _topological(tasks: dict) -> list[str]:
    order, seen = [], set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for other in sorted(_needs(tasks[name])):
            visit(other)
        order.append(name)

    for name in sorted(tasks):
        visit(name)
    return order


def made_up_outputs(run_name: str, component: dict, parameters: dict) -> dict:
    """Default outputs of a container task: a recognisable value of each declared output's type (a LIST is
    two one-element lists, so that a ParallelFor over it has two iterations whose items are lists)."""
    out = {}
    for k, spec in component.get("outputDefinitions", {}).get("parameters", {}).items():
        tag = f"<{run_name}.{k}>"
        out[k] = {"LIST": [[f"{tag}[0]"], [f"{tag}[1]"]], "STRUCT": {"value": tag}, "NUMBER_INTEGER": 1, "NUMBER_DOUBLE": 0.5,
                  "BOOLEAN": True}.get(spec.get("parameterType"), tag)
    return out


Outputs = Callable[[str, dict, dict], dict]


def run_pipeline(spec: dict, arguments: dict, version: str, rng: random.Random, outputs: Outputs = made_up_outputs) -> dict[str, TaskRun]:
    """Every task of the pipeline, in dependency order, under `version`: container tasks of the root DAG by
    their task name, loops (LoopRun) too, and each iteration's tasks as `<loop>[<i>]/<task>`. `outputs`
    gives each container task's output parameters from what it received (default: made-up strings)."""
    root = spec["root"]
    inputs = {k: v.get("defaultValue") for k, v in root.get("inputDefinitions", {}).get("parameters", {}).items()}
    inputs.update(arguments)
    runs: dict[str, TaskRun] = {}
    _run_dag(spec, root, inputs, version, rng, runs, "", frozenset(), outputs)
    return runs


def _run_dag(spec: dict, dag: dict, dag_inputs: dict, version: str, rng: random.Random, runs: dict, prefix: str,
             before: frozenset, outputs: Outputs) -> dict:
    """One DAG's tasks; returns {task name: its outputs (a dict) or its LoopRun}."""
    executors = spec["deploymentSpec"]["executors"]
    produced: dict = {}
    finished: dict[str, frozenset] = {}
    tasks = dag["dag"]["tasks"]
    for name in _topological(tasks):
        task = tasks[name]
        component = spec["components"][task["componentRef"]["name"]]
        upstream = before.union(*(finished[d] for d in _needs(task)))
        run_name = prefix + name
        if "artifactIterator" in task:  # driver.go DAG: "ArtifactIterator is not implemented"
            raise BackendError(f"{run_name}: ArtifactIterator is not implemented")
        if "parameterIterator" in task:
            known = set(runs)
            loop = _run_loop(spec, task, component, dag_inputs, produced, version, rng, runs, run_name, upstream, outputs)
            produced[name], runs[run_name] = loop, loop
            finished[name] = upstream | {run_name} | (set(runs) - known)
            continue
        if "dag" in component:  # a condition's DAG (dsl.If / dsl.Else, and the branches' DAG around them)
            values = _resolve_task_inputs(task, component, dag_inputs, produced, run_name, version)
            condition = task.get("triggerPolicy", {}).get("condition")
            known = set(runs)
            if condition and not condition_holds(condition, values, run_name):
                produced[name] = {}  # skipped: the driver records Condition=false and Argo runs none of its tasks
            else:
                produced[name] = _run_dag(spec, component, values, version, rng, runs, run_name + "/", upstream, outputs)
            finished[name] = upstream | (set(runs) - known)
            continue
        container = executors[component["executorLabel"]]["container"]
        values = _resolve_task_inputs(task, component, dag_inputs, produced, run_name, version)
        executor_input = _executor_input(values, component)
        args = list(container.get("command", [])) + list(container.get("args", []))
        if _version(version) >= _version(DRIVER_RESOLVES_ARGS):
            args = resolve_container_args(args, values, run_name)
        args = substitute(args, executor_input, version, rng)
        received = _received(args, component, run_name)
        produced[name] = outputs(run_name, component, received)
        runs[run_name] = TaskRun(run_name, received, _pod_resources(container, executor_input), produced[name], upstream)
        finished[name] = upstream | {run_name}
    return produced


_CONDITION = re.compile(r"inputs\.parameter_values\['([^']+)'\] (==|!=) '([^']*)'")


def condition_holds(condition: str, values: dict, name: str) -> bool:
    """The DAG driver's trigger condition (2.5.0 driver.go DAG and 2.17.0 dag.go: expression.Condition, a CEL program over
    the task's resolved inputs, `inputs.parameter_values[...]`). The model evaluates the forms kfp's dsl.If / dsl.Else
    compile to: `inputs.parameter_values['K'] == 'V'` (or !=), and `!( ... )` of one; anything else is refused."""
    text = condition.strip()
    if text.startswith("!(") and text.endswith(")"):
        return not condition_holds(text[2:-1], values, name)
    match = _CONDITION.fullmatch(text)
    if not match:
        raise BackendError(f"{name}: condition {condition!r} is not a form this model evaluates; extend it before shipping one")
    key, op, literal = match.groups()
    if key not in values:
        raise BackendError(f"{name}: condition reads {key!r}, which the task's inputs do not have")
    return (values[key] == literal) == (op == "==")


def _run_loop(spec: dict, task: dict, component: dict, dag_inputs: dict, produced: dict, version: str, rng: random.Random,
              runs: dict, run_name: str, upstream: frozenset, outputs: Outputs) -> LoopRun:
    """A ParallelFor, as the 2.5.0 and 2.14+ drivers run it (driver.go DAG and resolveInputs; resolve.go
    at 2.14.0 keeps the same iteration rules). The loop's own driver resolves the task's inputs against
    the loop's DAG component, without the item input, and counts the items (getItems: a list, or a
    string of a JSON list); Argo runs that many iterations (argocompiler/dag.go iteratorTask: withSequence
    of the count, the loop template's `parallelism` = iteratorPolicy.parallelismLimit when > 0). Each
    iteration's driver starts from the loop's resolved inputs, drops the items input, sets the item input
    to items[i], and validates against the loop component's declared types again: an item declared
    STRING becomes JSON text there, whatever the inner task declares. The inner tasks then resolve their
    componentInputParameters from those values."""
    iterator = task["parameterIterator"]
    item_input, items_spec = iterator["itemInput"], iterator["items"]
    values = _resolve_task_inputs(task, component, dag_inputs, produced, run_name, version, skip=(item_input,))
    if "inputParameter" in items_spec:
        items_input = items_spec["inputParameter"]
        if items_input not in values:
            raise BackendError(f"{run_name}: iterating on item input {item_input!r} failed: cannot find input parameter")
        items = _items(values[items_input], run_name)
    else:  # raw: the JSON text of the items, added to the loop's inputs under the item input's name
        items_input = item_input
        values[item_input] = items = _items(items_spec["raw"], run_name)
    limit = task.get("iteratorPolicy", {}).get("parallelismLimit", 0)
    loop = LoopRun(run_name, dict(values), upstream=upstream, items=list(items), parallelism=limit if limit > 0 else None,
                   dag_outputs=component["dag"].get("outputs", {}).get("parameters", {}))
    for i, item in enumerate(items):
        iteration = {k: v for k, v in values.items() if k != items_input}
        iteration[item_input] = item
        iteration = _validate_and_convert(iteration, component, f"{run_name}[{i}]", skip=(items_input,))
        loop.iterations.append(_run_dag(spec, component, iteration, version, rng, runs, f"{run_name}[{i}]/", upstream | {run_name}, outputs))
    return loop


def unresolved(value, path: str = "") -> list[str]:
    """Where a received value still holds placeholder text."""
    if isinstance(value, str):
        return [f"{path or 'value'}: {value[:120]!r}"] if "{{$" in value else []
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in unresolved(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in unresolved(v, f"{path}[{i}]")]
    return []


# --- the platform spec: what each version's protos know ------------------------------------------------
# kubernetes_platform/proto/kubernetes_executor_config.proto at each tag (the backend builds against the
# tag's own copy: go.mod `replace .../kubernetes_platform => ./kubernetes_platform`), as JSON names, for
# KubernetesExecutorConfig and the messages fedpipe's pipelines use. 2.15.0 added SecretAsEnv.optional
# (kubeflow/pipelines#12216), 2.16.0 security_context (field 18); 2.16.1 and 2.17.0 changed no field of these
# messages (2.17.0 added CreatePvc.data_source, which fedpipe does not use); master after 2.17.0
# (KFP_2_18_SOURCE) added init_containers (field 19).
_CONFIG_2_5 = {"secretAsVolume", "secretAsEnv", "pvcMount", "nodeSelector", "podMetadata", "imagePullSecret", "imagePullPolicy",
               "configMapAsVolume", "configMapAsEnv", "activeDeadlineSeconds", "fieldPathAsEnv", "tolerations",
               "genericEphemeralVolume", "nodeAffinity", "podAffinity", "enabledSharedMemory", "emptyDirMounts"}
_MESSAGES_2_5 = {
    "secretAsEnv": {"secretName", "keyToEnv", "secretNameParameter"},
    "secretAsEnv.keyToEnv": {"secretKey", "envVar"},
    # the same four fields at every tag read, 2.5.0 to master 7b70c7b (the federation's CA: --federation-ca-secret)
    "secretAsVolume": {"secretName", "mountPath", "optional", "secretNameParameter"},
    "podMetadata": {"labels", "annotations"},
    "nodeSelector": {"labels", "nodeSelectorJson"},
    "tolerations": {"key", "operator", "value", "effect", "tolerationSeconds", "tolerationJson"},
    "fieldPathAsEnv": {"name", "fieldPath"},
}
KNOWN_FIELDS = {
    "2.5.0": (_CONFIG_2_5, _MESSAGES_2_5),
    "2.14.0": (_CONFIG_2_5, _MESSAGES_2_5),
    "2.15.0": (_CONFIG_2_5, {**_MESSAGES_2_5, "secretAsEnv": _MESSAGES_2_5["secretAsEnv"] | {"optional"}}),
    "2.16.0": (_CONFIG_2_5 | {"securityContext"}, {**_MESSAGES_2_5, "secretAsEnv": _MESSAGES_2_5["secretAsEnv"] | {"optional"},
                                                   "securityContext": {"runAsUser", "runAsGroup", "runAsNonRoot"}}),
}
KNOWN_FIELDS["2.16.1"] = KNOWN_FIELDS["2.17.0"] = KNOWN_FIELDS["2.16.0"]
KNOWN_FIELDS["2.18.0"] = (KNOWN_FIELDS["2.16.0"][0] | {"initContainers"}, KNOWN_FIELDS["2.16.0"][1])


def unknown_platform_fields(config: dict, version: str) -> list[str]:
    """Fields of one task's Kubernetes config that `version`'s protos do not know. Its API server parses
    the config strictly when it compiles a run (backend/src/v2/compiler/argocompiler/container.go): from
    2.14.0 `protojson.Unmarshal`, an unknown field refuses the run; at 2.5.0 `jsonpb.UnmarshalString`,
    whose error is ignored, so the pod silently loses its labels and annotations (`extendPodMetadata`)."""
    top, messages = KNOWN_FIELDS[version]
    problems = [name for name in config if name not in top]
    for path, fields in messages.items():
        head, _, sub = path.partition(".")
        items = config.get(head)
        items = items if isinstance(items, list) else [items] if isinstance(items, dict) else []
        if sub:
            items = [x for item in items for x in item.get(sub, [])]
        problems += [f"{path}.{key}" for item in items for key in item if key not in fields]
    return problems


def flat_tasks(spec: dict) -> dict[str, dict]:
    """Every container task of a compiled pipeline by name: the root DAG's and those inside its condition DAGs (dsl.If /
    dsl.Else; kfp names every task uniquely in the pipeline). A condition's DAG passes a root parameter P on as its own
    input `pipelinechannel--P`; here such an input reads P again, so that a check written against root tasks reads the
    root's parameters as the driver, one DAG at a time, ends up doing (`run_pipeline` models that chain itself)."""
    root = spec["root"].get("inputDefinitions", {}).get("parameters", {})
    out: dict[str, dict] = {}

    def visit(dag: dict, nested: bool) -> None:
        for name, task in dag["dag"]["tasks"].items():
            component = spec["components"][task["componentRef"]["name"]]
            if "dag" in component:
                visit(component, True)
                continue
            if name in out:
                raise BackendError(f"task name {name} appears twice in the pipeline")
            task = json.loads(json.dumps(task))
            for value in task.get("inputs", {}).get("parameters", {}).values():
                source = value.get("componentInputParameter", "")
                if nested and source.startswith("pipelinechannel--") and source.removeprefix("pipelinechannel--") in root:
                    value["componentInputParameter"] = source.removeprefix("pipelinechannel--")
            out[name] = task

    visit(spec["root"], False)
    return out
