#!/usr/bin/env python3
"""Regenerate the compiled pipelines the Helm chart ships for KFP's Kubernetes-native API mode.

    .venv/bin/python scripts/chart_pipelines.py           # write charts/fedpipe/files/pipelines/
    .venv/bin/python scripts/chart_pipelines.py --check   # exit 1, naming the stale files, if they are out of date

With `nativeMode.enabled` the chart creates the pipeline as `Pipeline` / `PipelineVersion` resources
(templates/native-pipeline.yaml) instead of compiling it in a registration Job, so it cannot run
Python: it embeds these copies, compiled here from pipelines/builder.py's `shipped_pipelines` with the
release defaults (`DeployOptions()`, environment ignored: the same pipelines as `fedpipe compile --all`),
and sets what the chart's values change. Never edit the copies by hand: change the builder, run this,
commit the result (tests/deploy/test_native_mode.py fails while they differ from a fresh compile).

What it writes:
- `<method>.json`: {"pipelineSpec": <the compiled file's first document>, "platformSpec": <its second,
  the Kubernetes platform config>}: the two fields of a PipelineVersion (KFP 2.16.0
  backend/src/crd/kubernetes/v2beta1/pipelineversion_types.go, PipelineVersionSpec). JSON, because
  Helm's `fromYaml` reads YAML 1.1 (an unquoted `y` or `on` would turn into a boolean) and `fromJson` has
  no such ambiguity.
- `index.json`: what the copies were compiled with (`compiledWith`: the release images, store, S3
  endpoint, Secret and its keys, Pushgateway), which the template replaces by the chart's values, and
  per method the paths of the constants that repeat the run-config fields' compiled defaults
  (`fieldDefaults`: the config task's `defaults`, against which it tells a field the run changed),
  which the template keeps equal to the parameters' defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "charts" / "fedpipe" / "files" / "pipelines"
INDEX = "index.json"


def _dump(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def field_default_paths(spec: dict) -> list[list]:
    """Paths of every constant that maps run-config fields ("train.rounds") to exactly their pipeline
    parameters' defaults (root parameter "train_rounds"): copies of the compiled defaults that must move
    with them."""
    params = spec["root"]["inputDefinitions"]["parameters"]

    def is_copy(node) -> bool:
        return (
            isinstance(node, dict)
            and node
            and all(isinstance(k, str) and "." in k for k in node)
            and all(
                k.replace(".", "_") in params and params[k.replace(".", "_")].get("defaultValue") == v for k, v in node.items()
            )
        )

    found = []

    def walk(node, path):
        if is_copy(node):
            found.append(path)
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, [*path, key])
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, [*path, i])

    walk(spec, [])
    if any(isinstance(step, int) for path in found for step in path):
        raise SystemExit(f"a field-defaults constant sits inside a list ({found}); the chart's template only sets map keys.")
    return found


def generate() -> dict[str, str]:
    """{file name: content} of the chart's copies, compiled now from the code."""
    from fedpipe import __version__
    from fedpipe.algorithms import ALGORITHMS
    from fedpipe.pipelines.builder import DeployOptions, compile_pipeline, shipped_pipelines

    release = DeployOptions()
    files, index = {}, {}
    pipelines = shipped_pipelines(release)
    with tempfile.TemporaryDirectory() as tmp:
        for method in ALGORITHMS:
            path = compile_pipeline(pipelines[f"{method}.yaml"], Path(tmp) / f"{method}.yaml")
            docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
            spec = next(doc for doc in docs if "pipelineInfo" in doc)
            platform = [doc for doc in docs if "platforms" in doc]
            if len(docs) != 1 + len(platform) or len(platform) > 1:
                raise SystemExit(f"{method}: expected a pipeline spec and at most one platform spec, got {len(docs)} documents.")
            files[f"{method}.json"] = _dump({"pipelineSpec": spec, "platformSpec": platform[0] if platform else None})
            index[method] = {"fieldDefaults": field_default_paths(spec)}
    files[INDEX] = _dump(
        {
            "generatedBy": "scripts/chart_pipelines.py (do not edit: run it again)",
            "fedpipeVersion": __version__,
            "compiledWith": {
                "image": release.image,
                "trainingImage": release.training_image,
                "store": release.store,
                "s3Endpoint": release.s3_endpoint,
                "s3Secret": release.s3_secret,
                "s3SecretKeys": list(release.s3_secret_keys),
                "pushgateway": release.pushgateway,
            },
            "pipelines": index,
        }
    )
    return files


def stale(files: dict[str, str], folder: Path = OUT) -> list[str]:
    """Names of the files in `folder` that differ from `files`, are missing, or are left over."""
    present = {p.name for p in folder.glob("*.json")} if folder.is_dir() else set()
    differ = [name for name, text in files.items() if not (folder / name).is_file() or (folder / name).read_text() != text]
    return sorted(differ + sorted(present - set(files)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    files = generate()
    out_of_date = stale(files)
    if args.check:
        if out_of_date:
            print(f"stale in {OUT.relative_to(REPO)}: {', '.join(out_of_date)}; run scripts/chart_pipelines.py", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name in set(out_of_date) - set(files):
        (OUT / name).unlink()
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"{len(files)} files in {OUT.relative_to(REPO)} ({len(out_of_date)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
