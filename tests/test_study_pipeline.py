"""The study pipeline (pipelines/study.py): its shape, what each task receives on a KFP backend (the model of
tests/kfp_backend.py, extended with ParallelFor and dsl.Collected from the driver's source), and a run end to
end with kfp's local runner, which executes ParallelFor and dsl.Collected (kfp 2.17: kfp/local/orchestrator/
enhanced_dag_orchestrator.py runs the iterations, executor_input_utils.py fills a Collected input)."""

import json
import random

import pytest
import yaml
from kfp import compiler, dsl
from kfp_backend import COLLECTED, EXECUTOR_INPUT_FIRST, RANDOM_ORDER, BackendError, LoopRun, run_pipeline, unresolved

from fedpipe.components.study import chunks, per_task
from fedpipe.pipelines.builder import SHIPPED, DeployOptions
from fedpipe.pipelines.study import EXAMPLE, STUDY_MIN_KFP, build_study_pipeline, compile_study_pipeline, deployed_study

TINY = """study: {name: tiny, store: STORE}
base: {data: {dataset: digits}, partition: {scheme: pathological, num_clients: 4}, model: {name: twonn},
       train: {local_epochs: 1, batch_size: 20}, engine: {clients: sequential}}
methods: [fedavg, local]
budget: {trials: 2, rounds: 1}
seeds: [0]
workers: 1
"""


def _spec(path):
    return next(yaml.safe_load_all(path.read_text()))


def _tasks(spec):
    return spec["root"]["dag"]["tasks"]


def fake_steps(run_name: str, component: dict, parameters: dict) -> dict:
    """Outputs as the study's tasks give them: three chunks of one job from each suggest / final runs task
    (tagged with the task's name), a summary per job from each run_trials task."""
    task = run_name.split("/")[-1]
    if task.startswith("suggest") or task == "final-runs":
        return {"Output": [[{"job": f"{run_name}#{i}"}] for i in range(3)]}
    if task.startswith("run-trials"):
        return {"Output": [{"done": job["job"]} for job in parameters["jobs"]]}
    return {}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The example study for parallelism 3: 8 trials (2 methods x 4) -> 3 batches of up to 3 tasks."""
    path = tmp_path_factory.mktemp("study") / "study.yaml"
    return _spec(compile_study_pipeline(EXAMPLE, path, parallelism=3, trials_per_task=1))


def test_the_batches_are_unrolled_from_the_budget(compiled):
    names = {t["taskInfo"]["name"] for t in _tasks(compiled).values()}
    assert {"suggest batch 1/3", "suggest batch 2/3", "suggest batch 3/3", "report"} <= names
    loops = {n: t for n, t in _tasks(compiled).items() if "parameterIterator" in t}
    assert len(loops) == 4  # three batches and the final runs
    assert all(t["iteratorPolicy"] == {"parallelismLimit": 3} for t in loops.values())
    params = compiled["root"]["inputDefinitions"]["parameters"]
    assert params["trials_per_task"] == {"defaultValue": 1, "isOptional": True, "parameterType": "NUMBER_INTEGER"}
    assert "parallelism" not in params  # fixed when compiled: ParallelFor(parallelism=) takes an int only
    study = json.loads(params["study_yaml"]["defaultValue"])
    assert study["study"]["store"] == DeployOptions().store  # a local folder would vanish with its pod
    assert len({n for n in _tasks(compiled) if n.startswith("suggest")}) == 3


def test_the_2_5_backend_cannot_run_it():
    """driver.go at 2.5.0 (getDAGTasks skips a ParallelFor's DAG): the first Collected input fails."""
    spec = _spec(SHIPPED / "study.yaml")
    with pytest.raises(BackendError, match=r"suggest-2: KFP 2.5.0 cannot resolve .* \(dsl.Collected\)"):
        run_pipeline(spec, {}, RANDOM_ORDER, random.Random(0), fake_steps)
    assert STUDY_MIN_KFP == COLLECTED == "2.14.0"


@pytest.mark.parametrize("version", [EXECUTOR_INPUT_FIRST, "2.16.0"])
def test_each_iteration_gets_its_chunk_and_the_next_step_gets_every_iterations_output(compiled, version):
    study_yaml = TINY.replace("STORE", "s3://bucket/studies")
    runs = run_pipeline(compiled, {"study_yaml": study_yaml, "trials_per_task": 2}, version, random.Random(0), fake_steps)
    loops = {n: r for n, r in runs.items() if isinstance(r, LoopRun)}
    assert sorted(loops) == ["for-loop-1", "for-loop-2", "for-loop-3", "for-loop-4"]
    by_loop = {}
    for name, loop in loops.items():
        assert loop.parallelism == 3 and len(loop.items) == 3
        inner = sorted(n for n in runs if n.startswith(name + "["))
        assert len(inner) == 3
        for i, run_name in enumerate(inner):  # iteration i receives item i, as a list (its declared type)
            assert runs[run_name].parameters["jobs"] == loop.items[i]
            assert runs[run_name].parameters["study_yaml"] == study_yaml
            assert runs[run_name].resources["acceleratorCount"] == "1" and runs[run_name].resources["resourceCpuLimit"] == "4"
        by_loop[name] = inner
    producers = {"suggest-2": "for-loop-1", "suggest-3": "for-loop-2", "final-runs": "for-loop-3", "study-report": "for-loop-4"}
    inputs = {"suggest-2": "previous", "suggest-3": "previous", "final-runs": "tuned", "study-report": "finals"}
    for task, loop in producers.items():
        # the collected list: each iteration's output, in iteration order, and the task starts after all of them
        assert runs[task].parameters[inputs[task]] == [runs[n].outputs["Output"] for n in by_loop[loop]]
        assert set(by_loop[loop]) <= runs[task].upstream
        assert runs[task].parameters["study_yaml"] == study_yaml
        assert runs[task].resources == {"resourceCpuLimit": "2", "resourceCpuRequest": "500m",
                                        "resourceMemoryLimit": "8Gi", "resourceMemoryRequest": "1Gi"}
    assert [runs[f"suggest{s}"].parameters["batches_left"] for s in ("", "-2", "-3")] == [3, 2, 1]
    assert all(runs[s].parameters["trials_per_task"] == 2 for s in ("suggest", "suggest-2", "suggest-3", "final-runs"))
    assert set(by_loop["for-loop-1"]) <= runs["study-report"].upstream  # batches in a row, then the finals
    assert not any(unresolved(r.parameters) for r in runs.values())


def test_a_loop_over_no_items_leaves_nothing_to_collect(compiled):
    """resolve.go at 2.14.0: with iteration_count 0 the driver does not collect and the task after the loop
    fails; so the study's tasks never hand a loop an empty list (components/study.py, chunks)."""

    def empty_batches(run_name, component, parameters):
        out = fake_steps(run_name, component, parameters)
        return {"Output": []} if run_name == "suggest-2" else out

    with pytest.raises(BackendError, match="suggest-3: ParallelFor for-loop-2 had no iteration"):
        run_pipeline(compiled, {}, EXECUTOR_INPUT_FIRST, random.Random(0), empty_batches)
    assert chunks([], 3) == [[]]
    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_a_loop_item_declared_string_does_not_reach_a_list_input(tmp_path):
    """Why suggest returns list[list]: for a bare `list` the SDK declares the loop item STRING, and each
    iteration's driver (driver.go resolveInputs, handleParamTypeValidationAndConversion over the loop's
    component) turns the item into JSON text, which the inner task's LIST input refuses."""

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def make() -> list:
        return [[1], [2]]

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def take(jobs: list) -> int:
        return len(jobs)

    @dsl.pipeline(name="items")
    def items():
        with dsl.ParallelFor(make().output):
            pass

    @dsl.pipeline(name="bare")
    def bare():
        with dsl.ParallelFor(make().output) as item:
            take(jobs=item)

    compiler.Compiler().compile(bare, str(tmp_path / "bare.yaml"))
    spec = _spec(tmp_path / "bare.yaml")
    loop = next(c for c in spec["components"].values() if "dag" in c)
    assert loop["inputDefinitions"]["parameters"]["pipelinechannel--make-Output-loop-item"]["parameterType"] == "STRING"
    outputs = lambda name, component, parameters: {"Output": [[1], [2]]} if name == "make" else {"Output": 1}  # noqa: E731
    with pytest.raises(BackendError, match=r"take: input parameter 'jobs' type mismatch: expect LIST, got STRING"):
        run_pipeline(spec, {}, EXECUTOR_INPUT_FIRST, random.Random(0), outputs)


def test_each_batch_grows_when_the_compiled_batches_would_not_spend_the_budget():
    assert per_task(8, 4, 1, 2) == 1  # as compiled: 8 trials, 2 batches of 4 tasks
    assert per_task(20, 4, 1, 2) == 3  # a larger budget set in the UI: the two batches still ask for all of it
    assert per_task(5, 4, 1, 1) == 2  # the last batch takes every trial left
    assert per_task(0, 4, 2, 1) == 2


def test_the_compiled_study_is_self_contained(tmp_path):
    (tmp_path / "base.yaml").write_text("data: {dataset: digits}\npartition: {scheme: pathological, num_clients: 4}\n")
    (tmp_path / "s.yaml").write_text("study: {name: b, store: runs}\nbase_config: base.yaml\nbase: {train: {batch_size: 20}}\n"
                                     "methods: [fedavg]\nbudget: {trials: 3, rounds: 1}\nseeds: [0]\n")
    text, total = deployed_study(tmp_path / "s.yaml", DeployOptions(store="s3://b/p"))
    tree = json.loads(text)
    assert "base_config" not in tree and tree["base"]["partition"]["num_clients"] == 4 and tree["base"]["train"]["batch_size"] == 20
    assert tree["study"]["store"] == "s3://b/p" and total == 3


def test_the_study_pipeline_runs_locally(tmp_path):
    """The whole pipeline with kfp's local runner (each task its own process, ~10 s of imports each): 2
    methods x 2 trials in one batch of two tasks of two trials, the final runs in one task (Collected from
    the batch), the report (Collected from the final runs); the records and the report land in the
    study's store. One batch keeps it near a minute and a half; the chaining of batches (each suggest
    after every task of the batch before) is checked on the model above."""
    from fedpipe.pipelines.local_runner import run_locally

    text = TINY.replace("STORE", str(tmp_path / "store"))
    pipeline = build_study_pipeline(text, parallelism=2, trials_per_task=2)
    run = run_locally(pipeline, {"study_yaml": text}, tmp_path / "kfp")
    root = tmp_path / "store" / "studies" / "tiny"
    for method in ("fedavg", "local"):
        trials = sorted(p.name for p in (root / "trials" / method / "pathological").glob("*.json"))
        assert trials == ["0000.json", "0001.json"], (method, trials)
        assert (root / "finals" / method / "pathological" / "seed-0.json").is_file()
    assert (root / "chosen.json").is_file()
    html = (run / "study-report" / "report").read_text()
    assert html == (root / "report" / "study.html").read_text() and "fedavg" in html
    assert (run / "study-report" / "summary").read_text() == (root / "report" / "study.md").read_text()
    metrics = json.loads((root / "report" / "results.json").read_text())
    assert metrics
