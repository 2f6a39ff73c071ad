"""Talking to a Kubeflow Pipelines API: register a pipeline, submit a run, schedule retraining.

All three go through kfp's own Client. In a cluster it authenticates with the pod's projected
service-account token (audience pipelines.kubeflow.org, which kfp reads from
/var/run/secrets/kubeflow/pipelines/token); from a laptop, port-forward the API and pass --host.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedpipe import __version__
from fedpipe.errors import FedpipeError
from fedpipe.pipelines.builder import compile_pipeline
from fedpipe.store.base import sha256_hex

IN_CLUSTER_HOST = "http://ml-pipeline.kubeflow.svc.cluster.local:8888"


def connect(host: str | None, namespace: str | None = None):
    """A kfp Client for `host`; an unreachable API is a clear error, not a urllib3 traceback."""
    import kfp

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # kfp's notice about server versions
            client = kfp.Client(host=host, namespace=namespace or "kubeflow")
        client._healthz_api.healthz_service_get_healthz()  # kfp skips this probe in a namespace: do it always
        return client
    except Exception as e:
        raise FedpipeError(
            f"Cannot reach the Kubeflow Pipelines API at {host or '(default host)'}: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:300]}. Pass --host: in the cluster {IN_CLUSTER_HOST}; from a laptop run "
            "`kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80` and use --host http://localhost:8080."
        ) from None


def kfp_cron(expression: str) -> str:
    """Kubeflow's scheduler takes 6-field cron (seconds first); a usual 5-field one gets '0 ' in front."""
    fields = expression.split()
    if len(fields) == 5:
        return "0 " + " ".join(fields)
    if len(fields) == 6:
        return " ".join(fields)
    raise FedpipeError(f"--cron {expression!r} is not a cron expression: give 5 fields (minute hour day month weekday), e.g. '0 3 * * *'.")


def _api_call(what: str, call: Callable):
    try:
        return call()
    except FedpipeError:
        raise
    except Exception as e:  # ApiException and connection errors: say what failed and what the server said
        body = getattr(e, "body", None) or str(e)
        raise FedpipeError(f"Kubeflow Pipelines refused to {what}: {str(body).strip()[:500]}") from None


@dataclass(frozen=True)
class Registered:
    pipeline_id: str
    version_id: str
    version: str


def _package(pipeline, folder: str) -> Path:
    return compile_pipeline(pipeline, Path(folder) / "pipeline.yaml")


def register(client, pipeline, name: str, description: str = "") -> Registered:
    """Upload the compiled pipeline as `name`, or add it as a new version of `name`. A version is named
    after fedpipe's release and the compiled file's hash, so registering the same thing twice is a no-op."""
    with tempfile.TemporaryDirectory() as tmp:
        package = str(_package(pipeline, tmp))
        version = f"{__version__}-{sha256_hex(Path(package).read_bytes())[:12]}"
        pipeline_id = _api_call("look up the pipeline", lambda: client.get_pipeline_id(name))
        if pipeline_id is None:
            created = _api_call("upload the pipeline", lambda: client.upload_pipeline(package, pipeline_name=name, description=description))
            pipeline_id = created.pipeline_id
        versions = _api_call("list the pipeline's versions", lambda: client.list_pipeline_versions(
            pipeline_id, page_size=100, filter=json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": version}]})))
        found = [v for v in (versions.pipeline_versions or []) if v.display_name == version]
        if found:
            return Registered(pipeline_id, found[0].pipeline_version_id, version)
        made = _api_call("upload the pipeline version", lambda: client.upload_pipeline_version(
            package, pipeline_version_name=version, pipeline_id=pipeline_id, description=description))
        return Registered(pipeline_id, made.pipeline_version_id, version)


def _experiment_id(client, experiment: str, namespace: str | None) -> str:
    found = _api_call("look up the experiment", lambda: _get_experiment(client, experiment, namespace))
    if found is not None:
        return found.experiment_id
    return _api_call("create the experiment", lambda: client.create_experiment(experiment, namespace=namespace)).experiment_id


def _get_experiment(client, name: str, namespace: str | None):
    try:
        return client.get_experiment(experiment_name=name, namespace=namespace)
    except ValueError:  # kfp raises ValueError when no experiment has that name
        return None


def submit(client, pipeline, experiment: str, run_name: str, namespace: str | None = None) -> str:
    """Start one run of the pipeline; returns the run id."""
    with tempfile.TemporaryDirectory() as tmp:
        package = str(_package(pipeline, tmp))
        result = _api_call("create the run", lambda: client.create_run_from_pipeline_package(
            package, arguments={}, run_name=run_name, experiment_name=experiment, namespace=namespace))
    return result.run_id


def schedule(client, registered: Registered, job_name: str, cron: str, experiment: str, namespace: str | None = None) -> str:
    """A recurring run (scheduled retraining) of the registered version; an earlier schedule of the same
    name is replaced once the new one exists (a failure leaves the old one running). Runs do not catch
    up on missed times and never overlap."""
    cron6 = kfp_cron(cron)
    experiment_id = _experiment_id(client, experiment, namespace)
    listed = _api_call("list recurring runs", lambda: client.list_recurring_runs(
        experiment_id=experiment_id, page_size=100,
        filter=json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": job_name}]})))
    made = _api_call("create the recurring run", lambda: client.create_recurring_run(
        experiment_id=experiment_id, job_name=job_name, cron_expression=cron6, max_concurrency=1, no_catchup=True,
        pipeline_id=registered.pipeline_id, version_id=registered.version_id, enabled=True))
    for old in listed.recurring_runs or []:
        if old.display_name == job_name and old.recurring_run_id != made.recurring_run_id:
            _api_call("delete the previous schedule", lambda old=old: client.delete_recurring_run(old.recurring_run_id))
    return made.recurring_run_id
