"""Run a shipped, compiled pipeline on this machine with kfp's local runner (the embedded default).

Every task runs as its own Python process, as it would in its own pod; artifacts pass between
tasks as files under `pipeline_root`, and the run's store (the config's `run.store`) holds the
checkpoints and the report. The run id is the config's, so running the same config again reuses
the finished steps and resumes an interrupted one.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import warnings
from collections import deque
from pathlib import Path

from kfp import components, local

from fedpipe.errors import FedpipeError
from fedpipe.pipelines.builder import SHIPPED, DeployOptions, method_pipeline
from fedpipe.run.config import RunConfig

ANSI = re.compile(r"\x1b\[[0-9;]*m")
USER_ERROR = re.compile(r"fedpipe\.errors\.\w+: (.*)")


class _TaskLog(io.TextIOBase):
    """Shows the tasks' progress lines (fedpipe's own and the runner's task status), keeps the rest
    for an error message; everything with verbose=True."""

    def __init__(self, out, verbose: bool):
        self.out, self.verbose = out, verbose
        self.recent: deque[str] = deque(maxlen=400)
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            plain = ANSI.sub("", line)
            self.recent.append(plain)
            keep = plain.strip().startswith("fedpipe:") or "Executing task" in plain or "finished with status" in plain
            if self.verbose or keep:
                self.out.write((line if self.out.isatty() else plain).strip() + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def user_error(self) -> str | None:
        """The one-paragraph message of a fedpipe error raised inside a task, if there was one."""
        for line in reversed(self.recent):
            if m := USER_ERROR.search(line):
                return m.group(1)
        return None


def compiled_pipeline(method: str) -> Path:
    path = SHIPPED / f"{method}.yaml"
    if not path.is_file():
        raise FedpipeError(f"No compiled pipeline for method {method!r} at {path}; run `fedpipe compile --all`.")
    return path


def run_method_locally(cfg: RunConfig, pipeline_root: Path, verbose: bool = False) -> Path:
    """The method's shipped compiled pipeline, with `cfg` as its base config (run id pinned to the
    config's, so a rerun reuses finished steps). Returns the folder of the pipeline run's artifacts."""
    if os.environ.get("FEDPIPE_S3_ENDPOINT"):
        # the shipped pipeline's tasks name the in-cluster MinIO (DeployOptions.s3_endpoint), and the local
        # runner gives a task the env its spec names: build it for this machine's S3 endpoint instead
        pipeline = method_pipeline(cfg, DeployOptions.from_env(store=cfg.run.store))
    else:
        pipeline = components.load_component_from_file(str(compiled_pipeline(cfg.method.name)))
    pinned = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": cfg.run_id()})})
    return run_locally(pipeline, {"base_config": pinned.to_yaml()}, pipeline_root, verbose)


def run_locally(pipeline, arguments: dict, pipeline_root: Path, verbose: bool = False) -> Path:
    """Execute `pipeline` (compiled or built) with kfp's local runner; raises FedpipeError on failure.
    Returns the folder holding this pipeline run's task artifacts."""
    # No scheduler hands out GPUs here: an empty count lets the device probe look at the machine itself
    # (the compiled default "1" would say a GPU was given, and stop a run on a laptop without one).
    arguments = {"accelerator_count": "", **arguments}
    root = Path(pipeline_root)
    root.mkdir(parents=True, exist_ok=True)
    before = set(root.iterdir())
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    log = _TaskLog(sys.stderr, verbose)
    try:
        with contextlib.redirect_stdout(log), warnings.catch_warnings():
            # the runner warns that the tasks' image and resource settings do not apply locally:
            # expected, the tasks run in this Python environment on this machine
            warnings.simplefilter("ignore")
            pipeline(**arguments)
    except Exception as e:  # the runner raises RuntimeError for a failed task
        message = log.user_error()
        if message:
            raise FedpipeError(message) from None
        tail = "\n".join(list(log.recent)[-30:])
        raise FedpipeError(f"The local pipeline run failed: {e}\nLast lines of the task's log:\n{tail}") from None
    new = sorted(set(root.iterdir()) - before, key=lambda p: p.stat().st_mtime)
    return new[-1] if new else root
