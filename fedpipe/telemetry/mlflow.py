"""Telemetry sink that tracks a run in MLflow: per-round metrics, the config as params, tags, the report.

One fedpipe run is one MLflow run. Per round ONE ``log_batch`` request logs, with ``step`` = the
event's global round: ``train_loss``, ``personalized_accuracy`` and ``global_accuracy`` (on rounds
that evaluated them), ``bytes_uploaded``, ``bytes_downloaded``, ``seconds``, ``samples_per_second``,
``clients``, ``failed_clients`` and every `RoundEvent.extra` scalar under its own name (with privacy on, only
what `fedpipe.telemetry.release` allows: the accuracies, epsilon, delta and the clip). When the run
starts, the flattened config goes in as params (dotted keys such as ``train.lr``; values cut at
MLflow's 6000 characters) and tags name it: ``method``, ``dataset``, ``phase`` (the phase being
trained), ``phases``, ``split`` (the partition scheme), ``seed``, ``pipeline``, ``fedpipe.run_id``, and
``kfp.run_id`` / ``kfp.pod_name`` from ``KFP_RUN_ID`` / ``KFP_POD_NAME`` when set. When the run's
evaluation has finished, everything under its ``report/`` keys (report.md and .html, summary.json, the
plots, the rounds' JSONL; with privacy on, the JSONL stays in the store: it holds the un-noised figures) is
logged as artifacts under ``report/`` and the MLflow run is ended.

Which server and which MLflow run:

- the tracking URI is ``telemetry.mlflow``, else ``MLFLOW_TRACKING_URI``; with neither, no sink is made
  and ``mlflow`` is never imported (it is imported lazily, on the first event);
- ``MLFLOW_RUN_ID`` (what Kubeflow Pipelines' native MLflow integration, KEP-12862, sets on a task's
  container: the task's nested run) makes the sink log INTO that run, and leave ending it to KFP;
  ``MLFLOW_EXPERIMENT_ID`` picks the experiment (else ``telemetry.mlflow_experiment``, created when
  missing). Both belong to the server in ``MLFLOW_TRACKING_URI``, so they are ignored when
  ``telemetry.mlflow`` names another server;
- a parent run (``parent_run_id``, or ``FEDPIPE_MLFLOW_PARENT_RUN_ID`` so a study's trial processes
  inherit it; see `start_parent_run`) makes the run a nested child (tag ``mlflow.parentRunId``), in the
  parent's experiment; a parent wins over ``MLFLOW_RUN_ID`` (a study inside a KFP task nests its parent
  run under the task's run, and its trials under that parent);
- otherwise the sink continues the RUNNING MLflow run tagged with the same ``fedpipe.run_id`` (and
  parent), so a run's phases, a resumed run and its evaluation land in one MLflow run; or creates one.
- credentials: MLflow's own variables (``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME`` and
  ``MLFLOW_TRACKING_PASSWORD``, ...), which the client reads itself; never in the URI. They belong to the
  server of ``MLFLOW_TRACKING_URI`` (scheme, host and port): a call to any other server (a
  ``telemetry.mlflow`` or a study's ``mlflow:`` naming another one) runs with them hidden (`CREDENTIAL_ENV`
  out of the environment, the ``~/.mlflow/credentials`` file unread), with one warning naming both servers.

fedpipe's own MLflow calls run with short HTTP settings (`HTTP_SETTINGS`: 2 retries, a 15 s timeout,
instead of MLflow's 7 retries over minutes; no "View run" line on stdout), set in the environment only around each call and only
where the variable is unset, so a user's own values and their own MLflow calls are left alone.

If the server cannot be reached (or refuses a call), training goes on: the sink logs ONE warning
(which URI, that metrics are not being tracked, what to check) and makes no further attempt. The
failure is remembered for the process for `RETRY_AFTER_SECONDS`: later sinks and helpers for that URI
(the next phase, the report) skip it silently instead of waiting for a timeout again. It never raises.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from fedpipe.telemetry.events import PhaseEvent, RoundEvent

__all__ = [
    "ENV_PARENT_RUN",
    "HTTP_SETTINGS",
    "MlflowSink",
    "finish_run",
    "flat_params",
    "is_trusted",
    "log_artifacts",
    "start_parent_run",
    "resolve_tracking_uri",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

ENV_TRACKING_URI = "MLFLOW_TRACKING_URI"
ENV_RUN_ID = "MLFLOW_RUN_ID"  # set by KFP's native MLflow integration: the task's nested run
ENV_EXPERIMENT_ID = "MLFLOW_EXPERIMENT_ID"
ENV_PARENT_RUN = "FEDPIPE_MLFLOW_PARENT_RUN_ID"  # set by a study for its trial processes
#: env variable -> tag: KFP_RUN_ID is what fedpipe's components may set; KFP itself gives a task only
#: KFP_POD_NAME and KFP_POD_UID (kubeflow/pipelines backend/src/v2/compiler/argocompiler/common.go)
KFP_TAGS = {"KFP_RUN_ID": "kfp.run_id", "KFP_POD_NAME": "kfp.pod_name"}
TAG_RUN_ID = "fedpipe.run_id"
TAG_PARENT = "mlflow.parentRunId"
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
MAX_TAG_CHARS = 8000  # MLflow's limit on a tag value
#: fedpipe's client settings for its MLflow calls (only where the variable is unset; MLflow's defaults are
#: 7 retries with exponential backoff and a 120 s timeout: minutes of a stalled training loop; and a
#: "View run" line printed to stdout when a run ends: fedpipe logs the run instead)
HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
RETRY_AFTER_SECONDS = 300.0  # a server that failed is skipped this long by later sinks of the process
#: What the MLflow client sends as credentials, read from the environment on every request
#: (mlflow.utils.credentials.get_default_host_creds, also by the artifact repositories): a token or a user
#: and password, an auth plugin (kubernetes: the pod's service-account token), AWS SigV4 signing, a TLS client certificate
CREDENTIAL_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_AUTH",
                  "MLFLOW_TRACKING_AWS_SIGV4", "MLFLOW_TRACKING_CLIENT_CERT_PATH")

_down: dict[str, float] = {}  # tracking URI -> time.monotonic() of its last failure (process-wide)
_env_lock = threading.Lock()
# one fedpipe MLflow call at a time: a call to a foreign server hides the credentials process-wide, and a call
# to the trusted server in another thread meanwhile would go without them
_call_lock = threading.RLock()
_warned_foreign: set[str] = set()  # servers already warned about (once a process)


def resolve_tracking_uri(configured: str | None) -> str | None:
    """The tracking URI to use: `configured` (telemetry.mlflow), else env MLFLOW_TRACKING_URI, else None."""
    uri = (configured or "").strip() or os.environ.get(ENV_TRACKING_URI, "").strip()
    return uri or None


def _env_for(uri: str, name: str) -> str | None:
    """An MLflow variable of the server in MLFLOW_TRACKING_URI, when `uri` is that server."""
    if os.environ.get(ENV_TRACKING_URI, "").strip() != uri:
        return None
    return os.environ.get(name, "").strip() or None


def flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A config tree as MLflow params: dotted keys (``train.lr``), text values cut at 6000 characters."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = (value if isinstance(value, str) else json.dumps(value, default=str))[:MAX_PARAM_CHARS]
    return out


@contextmanager
def _short_http() -> Iterator[None]:
    """`HTTP_SETTINGS` in the environment for the duration of one fedpipe call, where unset."""
    with _env_lock:
        added = [name for name in HTTP_SETTINGS if name not in os.environ]
        for name in added:
            os.environ[name] = HTTP_SETTINGS[name]
    try:
        yield
    finally:
        with _env_lock:
            for name in added:
                os.environ.pop(name, None)


def _origin(uri: str) -> str | None:
    """scheme://host:port of an HTTP(S) URI (the port spelled out), None for anything else (a file store, sqlite, databricks)."""
    parts = urlsplit(uri.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:  # a port that is not a number: no server of ours
        return None
    return f"{scheme}://{parts.hostname}:{port}" if scheme in ("http", "https") and parts.hostname else None


def is_trusted(uri: str) -> bool:
    """Whether MLflow's credentials may go to `uri`: it is MLFLOW_TRACKING_URI's server (same scheme, host and port)."""
    home = os.environ.get(ENV_TRACKING_URI, "").strip()
    if not home:
        return False
    return uri.strip() == home or (_origin(uri) is not None and _origin(uri) == _origin(home))


def _has_credentials() -> bool:
    return any(os.environ.get(name) for name in CREDENTIAL_ENV) or os.path.isfile(os.path.expanduser("~/.mlflow/credentials"))


@contextmanager
def _credentials_for(uri: str) -> Iterator[None]:
    """MLflow's credentials as they are for MLFLOW_TRACKING_URI's server; hidden for any other (the caller holds `_call_lock`)."""
    if is_trusted(uri) or not _has_credentials():
        yield
        return
    if (_origin(uri) or uri) not in _warned_foreign:
        _warned_foreign.add(_origin(uri) or uri)
        home = os.environ.get(ENV_TRACKING_URI, "").strip()
        log.warning("MLflow at %s is not the server of %s (%s): fedpipe sends it none of MLflow's credentials (%s, the "
                    "~/.mlflow/credentials file). If that server is yours, set %s to it.", _origin(uri) or uri, ENV_TRACKING_URI,
                    (_origin(home) or "a server without a host") if home else "unset", ", ".join(CREDENTIAL_ENV), ENV_TRACKING_URI)
    import mlflow.utils.credentials as mlflow_credentials

    with _env_lock:
        hidden = {name: os.environ.pop(name) for name in CREDENTIAL_ENV if name in os.environ}
    read_file = mlflow_credentials.read_mlflow_creds  # the username and password fall back to ~/.mlflow/credentials
    mlflow_credentials.read_mlflow_creds = lambda: mlflow_credentials.MlflowCreds(None, None)
    try:
        yield
    finally:
        mlflow_credentials.read_mlflow_creds = read_file
        with _env_lock:
            os.environ.update(hidden)


class _Server:
    """One tracking server as fedpipe talks to it: a lazily made client, one warning, no call after a failure."""

    def __init__(self, uri: str):
        self.uri = uri
        self.client = None
        self.failed = False

    def call(self, what: str, fn: Callable[[Any], T]) -> T | None:
        """fn(client), or None once this server has failed (here, or in this process lately)."""
        if self.failed:
            return None
        failed_at = _down.get(self.uri)
        if failed_at is not None and time.monotonic() - failed_at < RETRY_AFTER_SECONDS:
            self.failed = True
            log.debug("MLflow at %s failed %.0f s ago; not trying to %s.", self.uri, time.monotonic() - failed_at, what)
            return None
        try:
            with _call_lock, _short_http(), _credentials_for(self.uri):
                if self.client is None:
                    from mlflow.tracking import MlflowClient

                    self.client = MlflowClient(tracking_uri=self.uri)
                return fn(self.client)
        except Exception as exc:  # never raise into training
            self.failed = True
            _down[self.uri] = time.monotonic()
            log.warning(
                "Could not reach the MLflow tracking server at %s to %s (%s); training goes on, but this run's "
                "metrics are not being tracked in MLflow. Check the tracking URI (telemetry.mlflow or %s), the "
                "credentials (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD) and "
                "that the server is running; fedpipe tries again in %.0f minutes or in a new process.",
                self.uri,
                what,
                _reason(exc),
                ENV_TRACKING_URI,
                RETRY_AFTER_SECONDS / 60,
            )
            return None


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created when missing (a concurrent creator's is reused)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _tags(tags: Mapping[str, Any]) -> dict[str, str]:
    out = {str(k): str(v)[:MAX_TAG_CHARS] for k, v in tags.items() if v is not None}
    for env, tag in KFP_TAGS.items():
        value = os.environ.get(env, "").strip()
        if value:
            out.setdefault(tag, value)
    return out


class MlflowSink:
    """Tracks one fedpipe run in an MLflow run; implements the telemetry `Sink` (see the module docstring)."""

    def __init__(
        self,
        tracking_uri: str,
        *,
        fedpipe_run_id: str,
        experiment: str = "fedpipe",
        params: Mapping[str, str] | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        run_id: str | None = None,
        experiment_id: str | None = None,
    ):
        if not tracking_uri or not str(tracking_uri).strip():
            raise ValueError("MlflowSink needs the tracking URI, e.g. http://mlflow:5000")
        self.server = _Server(str(tracking_uri).strip())
        self.fedpipe_run_id = fedpipe_run_id
        self.experiment = experiment
        self.params = dict(params or {})
        self.tags = {**_tags(tags or {}), TAG_RUN_ID: fedpipe_run_id}
        self.parent_run_id = parent_run_id or os.environ.get(ENV_PARENT_RUN, "").strip() or None
        given = run_id or (None if self.parent_run_id else _env_for(self.server.uri, ENV_RUN_ID))
        self.owns_run = given is None  # a run given (KFP's task run) is ended by whoever made it
        self.run_id: str | None = given
        self.experiment_id = experiment_id or _env_for(self.server.uri, ENV_EXPERIMENT_ID)
        self.logged_rounds = 0
        self._started = False

    @classmethod
    def from_env(cls, configured_uri: str | None, **kwargs) -> MlflowSink | None:
        """A sink for telemetry.mlflow or MLFLOW_TRACKING_URI, or None when neither is set."""
        uri = resolve_tracking_uri(configured_uri)
        return cls(uri, **kwargs) if uri else None

    def __repr__(self) -> str:
        return f"MlflowSink({self.server.uri!r}, run={self.fedpipe_run_id!r})"

    @property
    def tracking_uri(self) -> str:
        return self.server.uri

    # -- Sink protocol -------------------------------------------------------------------------

    def phase_started(self, event: PhaseEvent) -> None:
        self._start({"phase": event.labels.phase})

    def round_finished(self, event: RoundEvent) -> None:
        if not self._start({"phase": event.labels.phase}):
            return
        from mlflow.entities import Metric

        stamp, step = int(time.time() * 1000), int(event.round)
        metrics = [Metric(name, float(value), stamp, step) for name, value in round_metrics(event).items()]
        if self.server.call(f"log round {step}", lambda c: c.log_batch(self.run_id, metrics=metrics) or True):
            self.logged_rounds += 1

    def phase_finished(self, event: PhaseEvent) -> None:
        pass  # the rounds are logged; the run ends with the report (`log_report`)

    def close(self) -> None:
        pass

    # -- the run's end -------------------------------------------------------------------------

    def log_report(self, files: Callable[[], Mapping[str, bytes]] | Mapping[str, bytes], finish: bool = True) -> bool:
        """Log the report files ({name: bytes}, or a function reading them, called only when the server is
        reachable) as artifacts under ``report/``; then end the MLflow run if this sink made or found it."""
        if not self._start({}):
            return False
        done = self.server.call(
            "log the run's report", lambda c: _upload(c, self.run_id, files() if callable(files) else files, "report")
        )
        if done is None:
            return False
        if finish and self.owns_run:
            self.server.call("end the MLflow run", lambda c: c.set_terminated(self.run_id, "FINISHED"))
        return not self.server.failed

    # -- internals -----------------------------------------------------------------------------

    def _start(self, tags: Mapping[str, str]) -> bool:
        """Find or make the MLflow run and log the params and tags once; True when the run can be logged to."""
        if self._started or self.server.failed:
            return self._started and not self.server.failed
        self._started = self.server.call("start tracking the run", lambda c: self._open(c, tags)) is not None
        return self._started

    def _open(self, client, tags: Mapping[str, str]) -> bool:
        from mlflow.entities import Param, RunTag

        all_tags = {**self.tags, **tags}
        params = self.params
        if self.run_id is None:
            self.run_id = self._find(client)
        if self.run_id is None:
            self.run_id = self._create(client, all_tags)
        else:  # a run that exists (KFP's task run, a later phase, a resume): only the params it lacks, since MLflow
            # refuses to change one (the engine choice is resolved per phase: the first phase's stays)
            logged = client.get_run(self.run_id).data.params
            params = {k: v for k, v in params.items() if k not in logged}
        log.info("Tracking run %s in MLflow at %s (MLflow run %s).", self.fedpipe_run_id, self.server.uri, self.run_id)
        client.log_batch(
            self.run_id,
            params=[Param(k, v) for k, v in params.items()],
            tags=[RunTag(k, v) for k, v in all_tags.items()],
        )
        return True

    def _experiment(self, client) -> str:
        if self.experiment_id is None:
            if self.parent_run_id:
                self.experiment_id = client.get_run(self.parent_run_id).info.experiment_id
            else:
                self.experiment_id = _experiment_id(client, self.experiment)
        return self.experiment_id

    def _find(self, client) -> str | None:
        """The RUNNING MLflow run of this fedpipe run (and parent), if any."""
        query = f"tags.`{TAG_RUN_ID}` = '{_quoted(self.fedpipe_run_id)}' and attributes.status = 'RUNNING'"
        if self.parent_run_id:
            query += f" and tags.`{TAG_PARENT}` = '{_quoted(self.parent_run_id)}'"
        runs = client.search_runs(
            [self._experiment(client)], filter_string=query, max_results=1, order_by=["attributes.start_time DESC"]
        )
        return runs[0].info.run_id if runs else None

    def _create(self, client, tags: Mapping[str, str]) -> str:
        extra = {TAG_PARENT: self.parent_run_id} if self.parent_run_id else {}
        run = client.create_run(self._experiment(client), tags={**tags, **extra}, run_name=self.fedpipe_run_id)
        return run.info.run_id


def round_metrics(event: RoundEvent) -> dict[str, float]:
    """What one round logs: {metric name: value}; a figure the event does not carry (None: an accuracy not
    evaluated this round, or withheld with privacy on, `fedpipe.telemetry.release`) is not logged; `extra` by its
    own names."""
    metrics: dict[str, float] = {}
    for name in ("train_loss", "bytes_uploaded", "bytes_downloaded", "seconds", "samples_per_second", "clients",
                 "failed_clients", "personalized_accuracy", "global_accuracy"):
        value = getattr(event, name)
        if value is not None:
            metrics[name] = value
    for name, value in (event.extra or {}).items():
        if value is not None and isinstance(value, (int, float)):
            metrics.setdefault(str(name), float(value))
    return {k: float(v) for k, v in metrics.items()}


def _quoted(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("'", "\\'")


def _upload(
    client, run_id: str, files: Mapping[str, bytes] | str | Path | Iterable[str | Path], artifact_path: str | None
) -> bool:
    """Log a folder, a list of files, or {name: bytes} as artifacts of `run_id` (under `artifact_path`)."""
    if isinstance(files, (str, Path)):
        client.log_artifacts(run_id, str(files), artifact_path)
    elif isinstance(files, Mapping):
        with tempfile.TemporaryDirectory(prefix="fedpipe-mlflow-") as tmp:
            for name, data in files.items():
                path = Path(tmp, name)
                if not path.resolve().is_relative_to(Path(tmp).resolve()):
                    raise ValueError(f"artifact name {name!r} leaves its folder")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            client.log_artifacts(run_id, tmp, artifact_path)
    else:
        for path in files:
            client.log_artifact(run_id, str(path), artifact_path)
    return True


# -- helpers for a study: a parent run with its trials nested ------------------------------------


def start_parent_run(
    tracking_uri: str | None,
    experiment: str = "fedpipe",
    name: str | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
) -> str | None:
    """Create a parent MLflow run (a study's) and return its id; None (with one warning) when the server
    is unreachable, or no tracking URI is given or in MLFLOW_TRACKING_URI. Give trials the id as
    ``MlflowSink(parent_run_id=...)`` or through env FEDPIPE_MLFLOW_PARENT_RUN_ID. Inside a KFP task
    (MLFLOW_RUN_ID set) the parent is nested under the task's run; MLFLOW_EXPERIMENT_ID wins over `experiment`."""
    uri = resolve_tracking_uri(tracking_uri)
    if uri is None:
        return None
    from_env = {TAG_PARENT: _env_for(uri, ENV_RUN_ID)} if _env_for(uri, ENV_RUN_ID) else {}

    def create(client) -> str:
        from mlflow.entities import Param

        experiment_id = _env_for(uri, ENV_EXPERIMENT_ID) or _experiment_id(client, experiment)
        run = client.create_run(experiment_id, tags={**_tags(tags or {}), **from_env}, run_name=name)
        text = {k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in (params or {}).items()}
        if text:
            client.log_batch(run.info.run_id, params=[Param(str(k), v[:MAX_PARAM_CHARS]) for k, v in text.items()])
        return run.info.run_id

    return _Server(uri).call("start the parent run", create)


def log_artifacts(tracking_uri: str | None, run_id: str, folder_or_files, artifact_path: str | None = None) -> bool:
    """Log a folder, an iterable of files, or {name: bytes} as artifacts of run `run_id`; False (with one
    warning) when the server is unreachable or no URI is known."""
    uri = resolve_tracking_uri(tracking_uri)
    if uri is None or not run_id:
        return False
    return bool(_Server(uri).call("log artifacts", lambda c: _upload(c, run_id, folder_or_files, artifact_path)))


def finish_run(tracking_uri: str | None, run_id: str, status: str = "FINISHED") -> bool:
    """End run `run_id` with `status` (FINISHED, FAILED or KILLED); False (one warning) when unreachable."""
    uri = resolve_tracking_uri(tracking_uri)
    if uri is None or not run_id:
        return False
    return _Server(uri).call("end the run", lambda c: c.set_terminated(run_id, status) or True) is not None
