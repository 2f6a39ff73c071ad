"""The Kubeflow Pipelines v2 components of a fedpipe run.

Each is a lightweight Python component whose body only calls `fedpipe.components.bodies` inside the project
image, so the same library runs here, in the CLI and in the tests. `build(image)` binds them to an
image; `compile_components` writes their specs to components/*.yaml for reuse in other pipelines.
"""


from dataclasses import dataclass
from pathlib import Path

from kfp import compiler, dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output


def resolve_config(base_config: str, fields: dict, defaults: dict, overrides: list, method: str, job_id: str, config: Output[Artifact]):
    """Validate the run's config (base YAML, changed fields, KEY=VALUE overrides) before anything runs."""
    from fedpipe.components import bodies

    cfg = bodies.resolve_config(base_config, fields, defaults, overrides, job_id, config.path, method=method or None)
    config.metadata.update({"run_id": cfg.run_id(), "method": cfg.method.name, "dataset": cfg.data.dataset})


def partition(config: Input[Artifact], manifest: Output[Dataset], heatmap: Output[HTML]):
    """Split the dataset over clients: the manifest (client -> sample indices) and a label heatmap."""
    from fedpipe.components import bodies

    manifest.metadata.update(bodies.partition(config.path, manifest.path, heatmap.path))


def train_phase(config: Input[Artifact], phase: str, manifest: Input[Dataset], state: Output[Model], metrics: Output[Metrics],
                previous: Input[Model] = None):
    """Run one training phase from the previous phase's state; checkpoints go to the run's store."""
    from fedpipe.components import bodies

    last = bodies.train_phase(config.path, phase, manifest.path, previous.path if previous is not None else None, state.path)
    state.metadata.update({"phase": phase, "round": int(last.get("round", 0))})
    for key in ("train_loss", "personalized_accuracy", "global_accuracy", "samples_per_second", "seconds"):
        if last.get(key) is not None:
            metrics.log_metric(key, float(last[key]))


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
    state.metadata.update({"phase": phase, "round": int(last.get("round", 0)), "pytorchjob_nodes": int(job["nodes"])})
    for key in ("train_loss", "personalized_accuracy", "global_accuracy", "samples_per_second", "seconds"):
        if last.get(key) is not None:
            metrics.log_metric(key, float(last[key]))


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
    return result["run_id"]


def compare(config: Input[Artifact], run_ids: list, table: Output[Markdown], results: Output[Artifact]) -> str:
    """The benchmark's comparison table over methods (same partition, same budget), from the runs' summaries."""
    from fedpipe.components import bodies

    return bodies.compare(config.path, run_ids, table.path, results.path)


FUNCTIONS = (resolve_config, partition, train_phase, launch_phase_job, evaluate, compare)


@dataclass(frozen=True)
class Components:
    resolve_config: object
    partition: object
    train_phase: object
    launch_phase_job: object
    evaluate: object
    compare: object


def build(image: str, training_image: str) -> Components:
    """The components, running in `image` (training in `training_image`: the CUDA image, so that a run asks
    for a GPU with a parameter alone; it runs on CPU-only nodes too); both must have fedpipe installed.
    The images' names come from fedpipe.pipelines.builder.DeployOptions."""

    def decorate(f):
        chosen = training_image if f is train_phase else image
        return dsl.component(base_image=chosen, install_kfp_package=False)(f)

    return Components(*(decorate(f) for f in FUNCTIONS))


def compile_components(folder: Path, image: str, training_image: str) -> list[Path]:
    """Write each component's spec to folder/<name>.yaml (loadable with kfp's load_component_from_file)."""
    built = build(image, training_image)
    Path(folder).mkdir(parents=True, exist_ok=True)
    paths = []
    for f in FUNCTIONS:
        path = Path(folder) / f"{f.__name__}.yaml"
        compiler.Compiler().compile(getattr(built, f.__name__), str(path))
        paths.append(path)
    return paths
