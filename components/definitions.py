"""The Kubeflow Pipelines v2 components of a fedpipe run.

Each is a lightweight Python component whose body only calls `fedpipe.components.bodies` inside the project
image, so the same library runs here, in the CLI and in the tests. `build(image)` binds them to an
image; `compile_components` writes their specs to components/*.yaml for reuse in other pipelines.

Every value a task receives is one top-level input parameter. A dict or list of pipeline parameters
(`fields={"train.rounds": train_rounds, ...}`) would compile to a constant holding
`{{$.inputs.parameters['pipelinechannel--...']}}` text, which KFP backends before 2.14.0 leave
unresolved at random (the launcher substituted `{{$}}` and those placeholders in one pass over a Go
map: backend/src/v2/component/launcher_v2.go, getPlaceholders; fixed by kubeflow/pipelines#11925).
So the config task and the comparison, whose inputs depend on the config's fields and the benchmark's
methods, are generated per pipeline with one parameter per value (`resolve_config_component`,
`compare_component`); tests/test_kfp_conformance.py runs every shipped pipeline through both launchers.
"""

import keyword
import linecache
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kfp import compiler, dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

# The parameters of the config task that are not config fields.
RESOLVE_FIXED = ("base_config", "defaults", "overrides", "method", "job_id", "config")


def _generated(name: str, source: str) -> Callable:
    """A component function from source text: kfp embeds `inspect.getsource(f)` in the task's command,
    and the container's kfp executor calls the function with the inputs its signature names, so a
    parameter list that depends on the pipeline has to be real source. linecache lets inspect find it."""
    filename = f"<fedpipe component {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"Input": Input, "Output": Output, "Artifact": Artifact, "Markdown": Markdown}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated source, no user text
    return namespace[name]


def _identifier(name: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{name!r} cannot be a component parameter name")
    return name


def resolve_config_component(defaults: dict[str, object]) -> Callable:
    """The config task for a pipeline whose parameters are `defaults`' fields ({"train.rounds": 30, ...}):
    one input parameter per field (`train_rounds: int`), each wired to the pipeline parameter of that name."""
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    params = [f"{_identifier(dotted.replace('.', '_'))}: {kinds[type(value)]}" for dotted, value in defaults.items()]
    clash = set(RESOLVE_FIXED) & {p.split(":")[0] for p in params}
    if clash:
        raise ValueError(f"config fields {sorted(clash)} clash with the config task's own parameters")
    signature = ",\n        ".join(["base_config: str", "defaults: dict", "overrides: list", "method: str", "job_id: str",
                                     "config: Output[Artifact]", *params])
    source = f'''def resolve_config(
        {signature}) -> str:
    """Validate the run's config (base YAML, changed fields, KEY=VALUE overrides) before anything runs. Returns its
    engine.mode (simulation or federation), which chooses the pipeline's branch."""
    from fedpipe.components import bodies

    given = locals()
    fields = {{dotted: given[dotted.replace(".", "_")] for dotted in defaults}}
    cfg = bodies.resolve_config(base_config, fields, defaults, overrides, job_id, config.path, method=method or None)
    config.metadata.update({{"run_id": cfg.run_id(), "method": cfg.method.name, "dataset": cfg.data.dataset, "mode": cfg.engine.mode}})
    return cfg.engine.mode
'''
    return _generated("resolve_config", source)


def compare_component(methods: list[str]) -> Callable:
    """The benchmark's comparison task: one input parameter per method (`run_id_fedavg: str`, ...), the
    run id its evaluate task returned."""
    names = [f"run_id_{_identifier(m)}" for m in methods]
    signature = ", ".join(["config: Input[Artifact]", "table: Output[Markdown]", "results: Output[Artifact]",
                           *(f"{n}: str" for n in names)])
    source = f'''def compare({signature}) -> str:
    """The benchmark's comparison table over methods (same partition, same budget), from the runs' summaries."""
    from fedpipe.components import bodies

    return bodies.compare(config.path, [{", ".join(names)}], table.path, results.path)
'''
    return _generated("compare", source)


def partition(config: Input[Artifact], manifest: Output[Dataset], heatmap: Output[HTML]):
    """Split the dataset over clients: the manifest (client -> sample indices) and a label heatmap."""
    from fedpipe.components import bodies

    manifest.metadata.update(bodies.partition(config.path, manifest.path, heatmap.path))


def train_phase(config: Input[Artifact], phase: str, manifest: Input[Dataset], state: Output[Model], metrics: Output[Metrics],
                previous: Input[Model] = None, requested_accelerators: str = ""):
    """Run one training phase from the previous phase's state; checkpoints go to the run's store. `state` is a
    pointer to the phase's final state in that store (URL, sha256, size), not the state's bytes.
    `requested_accelerators`: the GPUs the task asked for, which tells fedpipe.engine.devices whether a GPU
    that PyTorch cannot use was given to it (empty: unknown, the probe looks at the machine). Not named
    accelerator_count: kfp's compiler gives the task an input of that name for the pod's GPU limit."""
    import os

    from fedpipe.components import bodies

    if requested_accelerators:
        os.environ["FEDPIPE_ACCELERATOR_COUNT"] = requested_accelerators

    last = bodies.train_phase(config.path, phase, manifest.path, previous.path if previous is not None else None, state.path)
    state.metadata.update({"phase": phase, "round": int(last.get("round", 0)), **bodies.pointer_metadata(state.path)})
    for key in ("train_loss", "personalized_accuracy", "global_accuracy", "samples_per_second", "seconds"):
        if last.get(key) is not None:
            metrics.log_metric(key, float(last[key]))
    if (last.get("extra") or {}).get("epsilon") is not None:  # privacy.enabled: epsilon spent after the phase's last round
        metrics.log_metric("epsilon", float(last["extra"]["epsilon"]))


def launch_phase_job(config: Input[Artifact], phase: str, manifest: Input[Dataset], job: dict, image: str, storage: dict,
                     cpu_request: str, cpu_limit: str, memory_request: str, memory_limit: str, accelerator_type: str,
                     node_selector: dict, tolerations: list, s3_secret: str, state: Output[Model], metrics: Output[Metrics],
                     previous: Input[Model] = None):
    """Run one training phase as a Kubeflow Training Operator PyTorchJob (a phase that outgrows one GPU or
    node) and wait for it; same inputs and outputs as train_phase. Its pods get these resources each."""
    from fedpipe.components import bodies

    resources = {"cpu_request": cpu_request, "cpu_limit": cpu_limit, "memory_request": memory_request,
                 "memory_limit": memory_limit, "accelerator_type": accelerator_type, "node_selector": node_selector,
                 "tolerations": tolerations}
    last = bodies.launch_phase_job(config.path, phase, manifest.path, previous.path if previous is not None else None, state.path,
                                  job=job, image=image, resources=resources, storage=dict(storage, s3_secret=s3_secret))
    state.metadata.update({"phase": phase, "round": int(last.get("round", 0)), "pytorchjob_nodes": int(job["nodes"]),
                           **bodies.pointer_metadata(state.path)})
    for key in ("train_loss", "personalized_accuracy", "global_accuracy", "samples_per_second", "seconds"):
        if last.get(key) is not None:
            metrics.log_metric(key, float(last[key]))
    if (last.get("extra") or {}).get("epsilon") is not None:  # privacy.enabled: epsilon spent after the phase's last round
        metrics.log_metric("epsilon", float(last["extra"]["epsilon"]))


def evaluate(config: Input[Artifact], manifest: Input[Dataset], state: Input[Model], metrics: Output[Metrics],
             report: Output[HTML], summary: Output[Markdown]) -> str:
    """Evaluate the final models; the report (with its plots) as HTML, the summary as Markdown.
    Returns the run id (where the store keeps the report)."""
    from fedpipe.components import bodies

    result = bodies.evaluate(config.path, manifest.path, state.path, report.path, summary.path)
    metrics.log_metric("personalized_accuracy", float(result["personalized_accuracy"]["mean"]))
    if result["global_model"] is not None:
        for key in ("top1", "top5", "ece", "loss"):
            metrics.log_metric(f"global_{key}", float(result["global_model"][key]))
    if result.get("privacy"):  # privacy.enabled: the run's final epsilon at its delta
        metrics.log_metric("epsilon", float(result["privacy"]["epsilon"]))
        metrics.log_metric("privacy_delta", float(result["privacy"]["delta"]))
    return result["run_id"]


def publish(config: Input[Artifact], evaluated_run: str, decision: Output[Metrics], global_model: Output[Model],
            client_models: Output[Model], model_line: Output[Markdown]):
    """Register the evaluated run's models as the next version of its model line (registry.name; empty: nothing
    happens) and promote it if the gate says so. `global_model`: the exported global model; `client_models`: a
    folder of every client's personalized model with index.json (client -> file) and spec.json."""
    from fedpipe.components import bodies

    result = bodies.publish(config.path, evaluated_run, global_model.path, client_models.path, model_line.path)
    global_model.metadata.update(result["global_metadata"])
    client_models.metadata.update(result["clients_metadata"])
    decision.log_metric("published", int(result["published"]))
    if result["published"]:
        decision.log_metric("version", int(result["version"]))
        decision.log_metric("promoted", int(result["promoted"]))
        for side in ("candidate", "champion"):
            if result[side] is not None:
                decision.log_metric(f"{side}_{result['metric']}", float(result[side]))


def federated_census(config: Input[Artifact], census: Output[HTML]) -> str:
    """Federation mode: wait for the sites the config names (federation.sites, federation.site_names; a timeout names
    the missing ones) and take their census at the SuperLink: names, split sizes, label counts (noised with privacy
    on). Returns the sites' names, comma-separated. (components/federated.py has the federation tasks' work.)"""
    from fedpipe.components import federated

    return federated.census(config.path, census.path)


def federated_phase(config: Input[Artifact], phase: str, census: str, state: Output[Artifact], metrics: Output[Metrics],
                    previous: Input[Artifact] = None):
    """Federation mode: one training phase, its rounds trained at the sites (this task needs no GPU); every finished
    round goes to the run's telemetry (clients = the sites that answered). `state`: the stage's result (phase, last
    round, sites); the server's checkpoint stays in the run's store. `census`: the sites that answered it."""
    from fedpipe.components import federated

    last = federated.phase(config.path, phase, previous.path if previous is not None else None, state.path)
    state.metadata.update({"phase": phase, "round": int(last.get("round") or 0), "sites": census})
    for key in ("train_loss", "clients", "failed_clients", "bytes_uploaded", "bytes_downloaded"):
        if last.get(key) is not None:
            metrics.log_metric({"clients": "sites_answered", "failed_clients": "sites_failed"}.get(key, key), float(last[key]))


def federated_evaluate(config: Input[Artifact], state: Input[Artifact], metrics: Output[Metrics], report: Output[HTML],
                       summary: Output[Markdown]) -> str:
    """Federation mode: each site scores its models on its own splits (with registry.name also the model line's
    promoted global model, for the gate); the run's report. Returns the run id (where the store keeps the report)."""
    from fedpipe.components import federated

    result = federated.evaluate(config.path, state.path, report.path, summary.path)
    metrics.log_metric("personalized_accuracy", float(result["personalized_accuracy"]))
    metrics.log_metric("sites", float(result["sites"]))
    if result.get("global_accuracy") is not None:
        metrics.log_metric("global_accuracy", float(result["global_accuracy"]))
    if result.get("privacy"):
        metrics.log_metric("epsilon", float(result["privacy"]["epsilon"]))
    return result["run_id"]


FEDERATED_FUNCTIONS = (federated_census, federated_phase, federated_evaluate)
FIXED_FUNCTIONS = (partition, train_phase, launch_phase_job, evaluate, publish)


@dataclass(frozen=True)
class Components:
    resolve_config: object
    partition: object
    train_phase: object
    launch_phase_job: object
    evaluate: object
    publish: object
    federated_census: object
    federated_phase: object
    federated_evaluate: object
    compare: object  # None in a pipeline with no comparison


def build(image: str, training_image: str, fields: dict[str, object], methods: list[str] | None = None) -> Components:
    """The components, running in `image` (training in `training_image`: the CUDA image, so that a run asks
    for a GPU with a parameter alone; it runs on CPU-only nodes too); both must have fedpipe installed.
    `fields`: the config fields the pipeline exposes (the config task's parameters); `methods`: the
    benchmark's methods (the comparison's parameters). The images come from pipelines.builder.DeployOptions."""

    def decorate(f):
        chosen = training_image if f is train_phase else image
        return dsl.component(base_image=chosen, install_kfp_package=False)(f)

    fixed = {f.__name__: decorate(f) for f in (*FIXED_FUNCTIONS, *FEDERATED_FUNCTIONS)}
    compare = decorate(compare_component(methods)) if methods else None
    return Components(resolve_config=decorate(resolve_config_component(fields)), compare=compare, **fixed)


def compile_components(folder: Path, image: str, training_image: str, fields: dict[str, object], methods: list[str]) -> list[Path]:
    """Write each component's spec to folder/<name>.yaml (loadable with kfp's load_component_from_file);
    the config task's and the comparison's for these fields and methods."""
    built = build(image, training_image, fields, methods)
    Path(folder).mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("resolve_config", *(f.__name__ for f in (*FIXED_FUNCTIONS, *FEDERATED_FUNCTIONS)), "compare"):
        path = Path(folder) / f"{name}.yaml"
        compiler.Compiler().compile(getattr(built, name), str(path))
        paths.append(path)
    return paths
