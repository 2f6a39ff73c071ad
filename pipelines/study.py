"""A study (fedpipe.study) as a Kubeflow pipeline: tuning in batches, then the final runs, then the report.

    suggest 1 -> ParallelFor(run_trials) -> Collected -> suggest 2 -> ... -> suggest B -> ParallelFor(run_trials)
      -> Collected -> final runs -> ParallelFor(run_trials) -> Collected -> report (Metrics, study.html, study.md)

The batches are unrolled when the pipeline is compiled: B = ceil(total trials / (parallelism x
trials_per_task)), total trials = budget.trials x tuned methods x splits of the compiled study. Each
`suggest` takes the previous batch's collected results as an input, so it starts only once every trial
task of that batch has finished and Optuna sees their records (the store). Each run_trials task runs its
list of trials in one warm process (components/study.py).

Run parameters: `study_yaml` (the study's text, one line of JSON, which is YAML; its default is the
compiled study with a `base_config` file inlined and a local store replaced by the deployment's),
`trials_per_task`, and the tasks' resources (as in the method pipelines: accelerator_*, cpu_*, memory_*
for the run_trials tasks, step_* for the others, node_selector and tolerations). A study edited in the
UI with a larger budget still gets every trial: each suggest makes its tasks longer when the batches left
would not spend the budget (components/study.py, per_task); so does a smaller `trials_per_task`.

`parallelism` (how many run_trials tasks run at once) is fixed when the pipeline is compiled, not a run
parameter: kfp 2.17's `dsl.ParallelFor(parallelism=...)` takes an `int` only (kfp/dsl/tasks_group.py,
ParallelFor.__init__ compares it with 0), the pipeline spec's `iteratorPolicy.parallelismLimit` is an
int32, and the backend's Argo compiler copies it into the loop template's `parallelism` when it compiles
the run (backend/src/v2/compiler/argocompiler/dag.go, iteratorTask, at 2.5.0 as at 2.16.0).

Needs a Kubeflow Pipelines backend of 2.14.0 or later (STUDY_MIN_KFP; Kubeflow 1.11.0 ships 2.15.0):
`dsl.Collected` of a ParallelFor's outputs arrived in 2.14.0 (kubeflow/pipelines#11725, commit ed828b5,
backend/src/v2/driver: CollectInputs). The 2.5.0 driver of Kubeflow 1.10.1/1.10.2 cannot resolve it:
getDAGTasks skips a ParallelFor's DAG ("Found a ParallelFor task ... Skipping it"), so
resolveUpstreamParameters fails with "subTaskName ..., not in tasks" (driver.go at 2.5.0).
tests/kfp_backend.py models both; tests/test_study_pipeline.py runs the pipeline.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kfp import dsl, kubernetes

from fedpipe.components import study as study_components
from fedpipe.errors import ConfigError
from fedpipe.pipelines.builder import (
    PLACEMENT_PARAMETERS,
    SHIPPED,
    DeployOptions,
    _as_pipeline,
    _bind,
    _step,
    _storage,
    compile_pipeline,
    parse_kfp_version,
    queue,
    resource_defaults,
)
from fedpipe.study.config import StudyConfig, load_study, split_names

#: The oldest backend that resolves dsl.Collected (see the module's docstring).
STUDY_MIN_KFP = "2.14.0"
NAME = "fedpipe-study"
DEFAULT_PARALLELISM = 4
DEFAULT_TRIALS_PER_TASK = 1
#: The study the shipped pipelines/study.yaml is compiled from (a checkout's examples/).
#: The run_trials tasks' resource parameters (those of the method pipelines' training tasks).
RUN_RESOURCES = ("accelerator_type", "accelerator_count", "cpu_request", "cpu_limit", "memory_request", "memory_limit")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "study_digits.yaml"


def deployed_study(source: str | Path, options: DeployOptions) -> tuple[str, int]:
    """The study file (a Path) or text as the cluster runs it: see `deployable`."""
    study, base = load_study(source) if isinstance(source, Path) else load_study(None, text=source)
    return deployable(study, base, options)


def deployable(study: StudyConfig, base: dict, options: DeployOptions) -> tuple[str, int]:
    """The study as a pod runs it, as one line of JSON (kfp writes a parameter's default into the compiled
    file's header comment verbatim: a multi-line default would break that YAML), and its total number of
    tuning trials. The base config is inlined (a pod has no `base_config` file); a store that is not s3://
    becomes the deployment's (a folder in a pod is gone when the pod is). The KFP study pipeline and the
    Katib Experiments (`fedpipe study katib`) both run this text."""
    tree = {**study.model_dump(mode="json", exclude={"base_config"}), "base": base}
    if not study.study.store.startswith("s3://"):
        tree["study"] = {**tree["study"], "store": options.store}
    text = json.dumps(tree, separators=(",", ":"))
    study, base = load_study(None, text=text)  # still valid as the tasks will read it
    total = study.budget.trials * sum(1 for e in study.methods if e.search_space()) * len(split_names(study, base))
    return text, total


def _signature(study_yaml: str, trials_per_task: int, options: DeployOptions) -> inspect.Signature:
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("study_yaml", kw, default=study_yaml, annotation=str),
              inspect.Parameter("trials_per_task", kw, default=trials_per_task, annotation=int)]
    params += [inspect.Parameter(name, kw, default=value, annotation=str) for name, value in resource_defaults(options.resources).items()]
    params += [inspect.Parameter(name, kw, default=default, annotation=kind) for name, (kind, default) in PLACEMENT_PARAMETERS.items()]
    return inspect.Signature(params)


def _components(options: DeployOptions) -> dict[str, Callable]:
    def decorate(f):
        chosen = options.training_image if f is study_components.run_trials else options.image
        return dsl.component(base_image=chosen, install_kfp_package=False)(f)

    return {f.__name__: decorate(f) for f in study_components.STUDY_FUNCTIONS}


def _run_tasks(c: dict, v: dict, options: DeployOptions, items, parallelism: int, what: str):
    """A ParallelFor of run_trials tasks over `items` (lists of jobs); returns their collected outputs."""
    with dsl.ParallelFor(items, parallelism=parallelism) as jobs:
        task = c["run_trials"](study_yaml=v["study_yaml"], jobs=jobs, requested_accelerators=v["accelerator_count"])
        task.set_display_name(what)
        task.set_accelerator_type(v["accelerator_type"]).set_accelerator_limit(v["accelerator_count"])
        task.set_cpu_request(v["cpu_request"]).set_cpu_limit(v["cpu_limit"])
        task.set_memory_request(v["memory_request"]).set_memory_limit(v["memory_limit"])
        # kfp 2.17's set_cpu_limit & co. do not register the pipeline parameters they name as the task's
        # channels, so the loop's DAG would not get them as inputs and the driver would fail the task
        # ("parent DAG does not have input parameter pipelinechannel--cpu_limit": tests/kfp_backend.py)
        task.register_pipeline_channels([v[k] for k in RUN_RESOURCES])
        kubernetes.add_node_selector_json(task, v["node_selector"])
        kubernetes.add_toleration_json(task, v["tolerations"])
        queue(task, options)  # Kueue's LocalQueue for the trials' GPU pods (--kueue-queue)
        task.set_retry(options.retries)  # a retry runs only the jobs that have no record yet
        _storage(task, options)
    return dsl.Collected(task.output)


def build_study_pipeline(study_yaml: str | Path, options: DeployOptions | None = None, parallelism: int = DEFAULT_PARALLELISM,
                         trials_per_task: int = DEFAULT_TRIALS_PER_TASK) -> Callable:
    """The study's pipeline. `study_yaml`: the study's text (or its file, whose base_config then resolves
    from the file's folder); `parallelism`: run_trials tasks at once (fixed here); `trials_per_task`: the
    default of the run parameter of that name. `options.kfp_version` below STUDY_MIN_KFP is raised to it
    (the platform spec is the same for 2.5.0 and 2.14.0); the server must still be 2.14.0 or later."""
    if parallelism < 1 or trials_per_task < 1:
        raise ConfigError(f"parallelism ({parallelism}) and trials per task ({trials_per_task}) must be at least 1.")
    options = options or DeployOptions()
    if parse_kfp_version(options.kfp_version) < parse_kfp_version(STUDY_MIN_KFP):
        options = replace(options, kfp_version=STUDY_MIN_KFP)
    text, total = deployed_study(study_yaml, options)
    batches = max(1, math.ceil(total / (parallelism * trials_per_task)))
    c = _components(options)
    signature = _signature(text, trials_per_task, options)

    def body(*args, **kwargs):
        v = _bind(signature, args, kwargs)
        previous = None
        for number in range(1, batches + 1):
            extra = {"previous": previous} if previous is not None else {}
            suggest = c["suggest"](study_yaml=v["study_yaml"], parallelism=parallelism, trials_per_task=v["trials_per_task"],
                                   batches_left=batches - number + 1, **extra)
            _step(suggest.set_display_name(f"suggest batch {number}/{batches}"), v, options)
            previous = _run_tasks(c, v, options, suggest.output, parallelism, f"trials of batch {number}")
        finals = c["final_runs"](study_yaml=v["study_yaml"], parallelism=parallelism, trials_per_task=v["trials_per_task"], tuned=previous)
        _step(finals.set_display_name("freeze the choice, list the final runs"), v, options)
        done = _run_tasks(c, v, options, finals.output, parallelism, "final runs")
        _step(c["study_report"](study_yaml=v["study_yaml"], finals=done).set_display_name("report"), v, options)

    return _as_pipeline(body, signature, NAME, f"A fedpipe study: {total} tuning trials in {batches} batches of up to "
                        f"{parallelism} tasks, then the final runs on every seed and the report. Needs KFP {STUDY_MIN_KFP}+.")


def compile_study_pipeline(study_yaml: str | Path, path: str | Path, options: DeployOptions | None = None,
                           parallelism: int = DEFAULT_PARALLELISM, trials_per_task: int = DEFAULT_TRIALS_PER_TASK) -> Path:
    """Compile the study's pipeline to `path` (see build_study_pipeline); returns the path."""
    return compile_pipeline(build_study_pipeline(study_yaml, options, parallelism, trials_per_task), Path(path))


def compile_shipped_study(folder: Path = SHIPPED, options: DeployOptions | None = None) -> Path:
    """pipelines/study.yaml: the example study (EXAMPLE) for the release's images and default store."""
    return compile_study_pipeline(EXAMPLE, Path(folder) / "study.yaml", options)
