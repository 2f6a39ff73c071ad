"""`fedpipe study`: many runs of many methods, tuned on validation, repeated over seeds."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import SetOpt, _guarded, app
from fedpipe.cli.deploy import _deploy_flags, _options

# --- studies: many runs of many methods, tuned on validation, repeated over seeds -----------------------
study_app = typer.Typer(
    help="A study: every method tuned on validation with the same budget (Optuna), rerun on several seeds, compared with "
    "confidence intervals and paired tests. `fedpipe study -c study.yaml` runs (or resumes) one here; see examples/study_*.yaml.",
    invoke_without_command=True, no_args_is_help=False,
)
app.add_typer(study_app, name="study")
StudyOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="The study file (YAML, see examples/study_*.yaml).")]


@study_app.callback()
@_guarded
def study_run(ctx: typer.Context, config: StudyOpt = None, set: SetOpt = None,
              workers: Annotated[Optional[int], typer.Option(help="Trials at once, each in a warm worker process (default: the study's `workers`).")] = None):
    """Run or resume the study: tuning trials (validation only), the frozen choice, the final runs on every seed and
    split (test), the papers' optimistic protocol beside, and the report (study.md, study.html, plots). A killed study
    resumes where it stopped: every finished trial and final run is reused."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(2)
    from fedpipe.study.config import load_study
    from fedpipe.study.runner import run_study

    study, base = load_study(config, [*(set or []), *([f"workers={workers}"] if workers else [])])
    results = run_study(study, base)
    typer.echo(_study_lines(results))


def _study_lines(results: dict) -> str:
    lines = [f"study {results['study']}: {results['budget']['trials']} trials x {results['budget']['rounds']} rounds per method, "
             f"seeds {results['seeds']} ({results.get('wall_seconds', 0):.0f} s)"]
    for name, m in results["methods"].items():
        for split in results["splits"]:
            accs = [f["test"]["personalized_accuracy"] for f in m["finals"] if f["split"] == split]
            mean = sum(accs) / len(accs) if accs else float("nan")
            lines.append(f"  {name:<12} {split:<14} test personalized {100 * mean:6.2f}%   chosen {m['chosen'].get(split, {})}")
    lines.append(f"  report                 {results.get('report', '')}")
    return "\n".join(lines)


@study_app.command("trial")
@_guarded
def study_trial(config: StudyOpt, method: Annotated[str, typer.Option(help="The method of this trial.")],
                param: Annotated[Optional[list[str]], typer.Option("--param", help="A hyperparameter of this trial, PATH=VALUE (repeatable), e.g. --param train.lr=0.05.")] = None,
                split: Annotated[Optional[str], typer.Option(help="The study's split (default: its first).")] = None,
                set: SetOpt = None):
    """One tuning trial, as Katib runs it: train with these hyperparameters, score on the clients' validation splits
    only, and print each metric as NAME=VALUE on its own line (Katib's StdOut metrics collector reads them)."""
    from fedpipe.errors import ConfigError
    from fedpipe.search_space import parse_value
    from fedpipe.study.config import load_study, run_tree, split_names
    from fedpipe.study.trials import execute, objective_of

    study, base = load_study(config, set)
    entry = next((e for e in study.methods if e.name == method), None)
    if entry is None:
        raise ConfigError(f"method {method!r} is not in the study; its methods: {', '.join(e.name for e in study.methods)}")
    split = split or next(iter(split_names(study, base)))
    space, params = entry.search_space(), {}
    for item in param or []:
        key, sep, raw = item.partition("=")
        if not sep or key not in space:
            raise ConfigError(f"--param {item!r}: write PATH=VALUE for a path of {method}'s space: {', '.join(space)}")
        params[key] = parse_value(space[key], raw, f"--param {key}")
    cfg = run_tree(study, base, entry, split, study.seeds[0], params, tuning=True)
    result = execute({"kind": "trial", "method": method, "split": split, "params": params, "config": cfg.model_dump(mode="json")})
    for name in ("val_personalized_accuracy", "val_pooled_accuracy", "val_global_accuracy", "val_worst10_accuracy"):
        value = objective_of(result["metrics"], name)
        if value is not None and math.isfinite(value):  # Katib reads `nan` as no value: leave such a line out
            typer.echo(f"{name}={value:.6f}")


@study_app.command("katib")
@_deploy_flags
@_guarded
def study_katib(config: StudyOpt, namespace: Annotated[str, typer.Option(help="The profile namespace the Experiments run in (it needs the label katib.kubeflow.org/metrics-collector-injection: enabled).")],
                algorithm: Annotated[str, typer.Option(help="Katib's suggestion algorithm: tpe, random, grid, bayesianoptimization, multivariate-tpe, cmaes.")] = "tpe",
                parallel: Annotated[int, typer.Option(help="Trials each Experiment runs at once.")] = 2,
                set: SetOpt = None, deploy: Optional[dict] = None):
    """Print the study as Katib Experiments (one per method, same budget) and the ConfigMap holding the study file:

        fedpipe study katib -c study.yaml --namespace kubeflow-user-example-com | kubectl apply -f -

    Each trial is a Job running `fedpipe study trial` (validation only); Katib's StdOut collector reads its NAME=VALUE lines."""
    import yaml

    from fedpipe.k8s.katib import katib_manifests
    from fedpipe.k8s.phasejob import StorageAccess
    from fedpipe.pipelines.study import deployable
    from fedpipe.study.config import load_study

    study, base = load_study(config, set)
    options = _options(deploy)
    text, _ = deployable(study, base, options)  # what the trial pods read: base inlined, the deployment's store
    storage = StorageAccess(s3_endpoint=options.s3_endpoint, s3_secret=options.s3_secret, s3_secret_keys=options.s3_secret_keys,
                            pushgateway=options.pushgateway, signing_secret=options.signing_secret)
    docs = katib_manifests(text, study.study.name, {e.name: e.search_space() for e in study.methods}, namespace=namespace,
                           image=options.image, max_trials=study.budget.trials, parallel_trials=parallel, seed=study.seeds[0],
                           objective_metric=study.objective, algorithm=algorithm, storage=storage, queue=options.kueue_queue)
    typer.echo(yaml.safe_dump_all(docs, sort_keys=False))


@study_app.command("compile")
@_guarded
@_deploy_flags
def study_compile(config: StudyOpt, out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the pipeline YAML.")] = Path("study.yaml"),
                  parallelism: Annotated[int, typer.Option(help="Trial tasks at once in each batch (dsl.ParallelFor's parallelism: fixed when compiled).")] = 4,
                  trials_per_task: Annotated[int, typer.Option(help="Trials one task runs in its warm process (default of the run parameter).")] = 1,
                  *, deploy: dict):
    """Compile the study as a Kubeflow pipeline (KFP >= 2.14): batches of trials fanned out with dsl.ParallelFor,
    collected with dsl.Collected into the next batch's suggestions, then the final runs and the report."""
    from fedpipe.pipelines.study import compile_study_pipeline

    typer.echo(compile_study_pipeline(Path(config), out, _options(deploy), parallelism=parallelism, trials_per_task=trials_per_task))
