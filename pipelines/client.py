"""Talking to a Kubeflow Pipelines API: register a pipeline, submit a run, schedule retraining (and
remove that schedule).

All of them go through kfp's own Client, after `connect` has checked the server: reachable, a KFP
backend new enough for fedpipe's pipelines (MIN_KFP_BACKEND), and, on multi-user Kubeflow, a
profile namespace to work in.

Credentials (the API server of multi-user Kubeflow wants a user identity on every call that
touches a namespace; see tests/kfp_api_standin.py for what it enforces, with the Go sources):

- in a pod: the projected service-account token, audience pipelines.kubeflow.org, at
  /var/run/secrets/kubeflow/pipelines/token (kfp's KF_PIPELINES_SA_TOKEN_PATH; the env var of that
  name, or --token-file, points elsewhere). It is re-read on every request, so the kubelet's
  rotation is seen. It is used whenever the file is there, --host given or not (kfp itself only
  uses it when no host is given);
- outside: env FEDPIPE_KFP_TOKEN (never a --token flag: argv is visible in `ps`), or
  --token-file, e.g. from
  `kubectl create token default-editor -n <profile> --audience pipelines.kubeflow.org`, with the API
  port-forwarded. A kubeconfig alone cannot work: through the Kubernetes API server's service
  proxy (kfp's route when no host is given) the Authorization header is consumed by that API
  server, so KFP sees no identity.

A single-user (standalone) KFP ignores both the token and the namespace.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedpipe import __version__
from fedpipe.config import refuse_url_credentials
from fedpipe.errors import FedpipeError
from fedpipe.pipelines.builder import MIN_KFP_BACKEND, compile_pipeline, parse_kfp_version
from fedpipe.store.base import sha256_hex

log = logging.getLogger(__name__)

IN_CLUSTER_HOST = "http://ml-pipeline.kubeflow.svc.cluster.local:8888"

# The oldest Kubeflow Pipelines backend that runs fedpipe's compiled pipelines (MIN_KFP_BACKEND, from
# the builder), checked against the server's healthz `tag_name` before anything is uploaded. Kubeflow
# 1.10.0 ships KFP 2.4.1; 1.10.1 is the first Kubeflow with 2.5.0 (kubeflow/manifests README per tag).
MIN_KUBEFLOW = "1.10.1"

# Where a pod finds its projected KFP token (kfp.client.KF_PIPELINES_SA_TOKEN_PATH); the chart mounts it there.
IN_CLUSTER_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
TOKEN_ENV = "FEDPIPE_KFP_TOKEN"
TOKEN_FILE_ENV = "KF_PIPELINES_SA_TOKEN_PATH"  # kfp's own variable for the token's path

def check_backend_version(tag: object, host: str) -> None:
    """Refuse a KFP backend older than MIN_KFP_BACKEND; warn and go on when its version is unknown."""
    found = parse_kfp_version(tag)
    needed = parse_kfp_version(MIN_KFP_BACKEND)
    if found is None:
        log.warning(
            "cannot tell the version of the Kubeflow Pipelines backend at %s (healthz tag_name %r); fedpipe's "
            "pipelines need KFP %s or newer (Kubeflow %s or newer). Going on; on an older backend the runs fail.",
            host, tag, MIN_KFP_BACKEND, MIN_KUBEFLOW)
        return
    if found < needed:
        raise FedpipeError(
            f"The Kubeflow Pipelines backend at {host} is version {tag}, and fedpipe's pipelines need KFP "
            f"{MIN_KFP_BACKEND} or newer (Kubeflow {MIN_KUBEFLOW} or newer has it; Kubeflow 1.9.1 ships KFP 2.3.0 and 1.10.0 ships 2.4.1): "
            "they set the tasks' resources, node selector and tolerations from run parameters, which older "
            "backends do not support. Upgrade Kubeflow Pipelines, then register again.")


def _read_token(path: str, what: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise FedpipeError(f"Cannot read the Kubeflow Pipelines token from {path} ({what}): {e.strerror or e}.") from None
    if not token:
        raise FedpipeError(f"The Kubeflow Pipelines token file {path} ({what}) is empty.")
    return token


def _credentials(token: str | None, token_file: str | None):
    """kfp.Client keyword arguments for the credentials: a token, a token file, the pod's projected token, or none."""
    from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

    if token:
        return {"existing_token": token.strip()}
    if token_file:
        _read_token(token_file, f"--token-file / env {TOKEN_FILE_ENV}")  # a clear error now, not a warning from kfp
        return {"credentials": ServiceAccountTokenVolumeCredentials(token_file)}
    if os.path.isfile(IN_CLUSTER_TOKEN_PATH):
        return {"credentials": ServiceAccountTokenVolumeCredentials(IN_CLUSTER_TOKEN_PATH)}
    return {}


def _healthz(client) -> dict:
    """The server's healthz JSON as sent (kfp_server_api's model drops tag_name and commit_sha)."""
    response = client._healthz_api.healthz_service_get_healthz(_preload_content=False)
    data = json.loads(response.data or b"{}")
    return data if isinstance(data, dict) else {}


def connect(host: str | None, namespace: str | None = None, token: str | None = None, token_file: str | None = None):
    """A kfp Client for `host`, checked: an unreachable API, a too-old backend and a multi-user server
    without a namespace are clear errors, not urllib3 tracebacks or a refusal halfway through.

    The namespace is `namespace`, else the one kfp keeps (~/.config/kfp/context.json, or in a pod on
    multi-user Kubeflow the pod's namespace); the returned client's user namespace is set to it."""
    import kfp

    for url, where in ((host, "--host"), (os.environ.get("KF_PIPELINES_ENDPOINT"), "env KF_PIPELINES_ENDPOINT")):
        try:
            refuse_url_credentials(url or "", f"The Kubeflow Pipelines API URL ({where})",
                                   f"the token goes in env {TOKEN_ENV} or a file named by --token-file.")
        except ValueError as e:
            raise FedpipeError(str(e)) from None
    credentials = _credentials(token, token_file)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # kfp's notice about server versions
            client = kfp.Client(host=host, namespace=namespace or "kubeflow", **credentials)
        health = _healthz(client)  # kfp skips its own probe in a namespace: do it always
    except Exception as e:
        raise FedpipeError(
            f"Cannot reach the Kubeflow Pipelines API at {host or '(default host)'}: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:300]}. Pass --host: in the cluster {IN_CLUSTER_HOST}; from a laptop run "
            "`kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80` and use --host http://localhost:8080."
        ) from None
    where = host or client._existing_config.host
    check_backend_version(health.get("tag_name"), where)
    namespace = namespace or client.get_user_namespace() or None
    if health.get("multi_user") is True and not namespace:
        raise FedpipeError(
            f"The Kubeflow Pipelines API at {where} is multi-user Kubeflow, where pipelines, experiments, runs and "
            "recurring runs belong to a profile namespace: pass --namespace with your profile's namespace "
            "(e.g. --namespace kubeflow-user-example-com).")
    # kfp's default namespace for experiments, in memory only (set_user_namespace would write ~/.config/kfp)
    client._context_setting["namespace"] = namespace or ""
    return client


def _namespace(client, namespace: str | None) -> str | None:
    return namespace or client.get_user_namespace() or None


def kfp_cron(expression: str) -> str:
    """Kubeflow's scheduler takes 6-field cron (seconds first); a usual 5-field one gets '0 ' in front."""
    fields = expression.split()
    if len(fields) == 5:
        return "0 " + " ".join(fields)
    if len(fields) == 6:
        return " ".join(fields)
    raise FedpipeError(f"--cron {expression!r} is not a cron expression: give 5 fields (minute hour day month weekday), e.g. '0 3 * * *'.")


_HINTS = {
    401: (" The server wants to know who is calling (multi-user Kubeflow): in a pod, mount a projected "
          "service-account token with audience pipelines.kubeflow.org at " + IN_CLUSTER_TOKEN_PATH + " (or pass "
          f"--token-file); outside, set {TOKEN_ENV} (never --token on the command line, which `ps` shows) to the output "
          "of `kubectl create token default-editor -n <profile namespace> --audience pipelines.kubeflow.org`, or "
          "write it to a file only you can read and pass --token-file."),
    403: " The caller is not allowed to do that in this namespace: check --namespace and the profile's role bindings.",
}


def _api_call(what: str, call: Callable):
    try:
        return call()
    except FedpipeError:
        raise
    except Exception as e:  # ApiException and connection errors: say what failed and what the server said
        body = getattr(e, "body", None) or str(e)
        raise FedpipeError(f"Kubeflow Pipelines refused to {what}: {str(body).strip()[:500]}{_HINTS.get(getattr(e, 'status', None), '')}") from None


@dataclass(frozen=True)
class Registered:
    pipeline_id: str
    version_id: str
    version: str


def _package(pipeline, folder: str) -> Path:
    return compile_pipeline(pipeline, Path(folder) / "pipeline.yaml")


def _by_name(name: str) -> str:
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]})


def _pipeline_id(client, name: str, namespace: str | None) -> str | None:
    """The pipeline called `name` in `namespace` (multi-user Kubeflow: the profile's own pipelines; kfp's
    get_pipeline_id only sees shared ones)."""
    found = client.list_pipelines(filter=_by_name(name), namespace=namespace, page_size=100).pipelines or []
    found = [p for p in found if p.display_name == name]
    if len(found) > 1:
        raise FedpipeError(f"Kubeflow has {len(found)} pipelines named {name!r}: pass --name to pick another name.")
    return found[0].pipeline_id if found else None


def register(client, pipeline, name: str, description: str = "", namespace: str | None = None) -> Registered:
    """Upload the compiled pipeline as `name`, or add it as a new version of `name`. A version is named
    after fedpipe's release and the compiled file's hash, so registering the same thing twice is a no-op.
    On multi-user Kubeflow the pipeline belongs to the namespace (a single-user server ignores it)."""
    namespace = _namespace(client, namespace)
    with tempfile.TemporaryDirectory() as tmp:
        package = str(_package(pipeline, tmp))
        version = f"{__version__}-{sha256_hex(Path(package).read_bytes())[:12]}"
        pipeline_id = _api_call("look up the pipeline", lambda: _pipeline_id(client, name, namespace))
        if pipeline_id is None:
            created = _api_call("upload the pipeline", lambda: client.upload_pipeline(
                package, pipeline_name=name, description=description, namespace=namespace))
            pipeline_id = created.pipeline_id
        versions = _api_call("list the pipeline's versions", lambda: client.list_pipeline_versions(
            pipeline_id, page_size=100, filter=_by_name(version)))
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
    """Start one run of the pipeline; returns the run id. The run belongs to the experiment's namespace
    (a v2beta1 run has no namespace of its own: the server takes the experiment's)."""
    namespace = _namespace(client, namespace)
    with tempfile.TemporaryDirectory() as tmp:
        package = str(_package(pipeline, tmp))
        experiment_id = _experiment_id(client, experiment, namespace)
        result = _api_call("create the run", lambda: client.create_run_from_pipeline_package(
            package, arguments={}, run_name=run_name, experiment_id=experiment_id))
    return result.run_id


def schedule(client, registered: Registered, job_name: str, cron: str, experiment: str, namespace: str | None = None) -> str:
    """A recurring run (scheduled retraining) of the registered version; an earlier schedule of the same
    name is replaced once the new one exists (a failure leaves the old one running). Runs do not catch
    up on missed times and never overlap. Like a run, it belongs to its experiment's namespace."""
    cron6 = kfp_cron(cron)
    namespace = _namespace(client, namespace)
    experiment_id = _experiment_id(client, experiment, namespace)
    listed = _api_call("list recurring runs", lambda: client.list_recurring_runs(
        experiment_id=experiment_id, page_size=100, filter=_by_name(job_name)))
    made = _api_call("create the recurring run", lambda: client.create_recurring_run(
        experiment_id=experiment_id, job_name=job_name, cron_expression=cron6, max_concurrency=1, no_catchup=True,
        pipeline_id=registered.pipeline_id, version_id=registered.version_id, enabled=True))
    for old in listed.recurring_runs or []:
        if old.display_name == job_name and old.recurring_run_id != made.recurring_run_id:
            _api_call("delete the previous schedule", lambda old=old: client.delete_recurring_run(old.recurring_run_id))
    return made.recurring_run_id


def unschedule(client, job_name: str, experiment: str, namespace: str | None = None) -> list[str]:
    """Delete the recurring runs named `job_name` in the experiment (what `schedule` made there); returns
    their ids, none when there is none or no such experiment (nothing is created). The chart's uninstall
    hook and an upgrade that empties schedule.cron call it, so a recurring run does not outlive its
    release. The server checks `delete` on jobs in the recurring run's namespace (job_server.go canAccessJob)."""
    namespace = _namespace(client, namespace)
    found = _api_call("look up the experiment", lambda: _get_experiment(client, experiment, namespace))
    if found is None:
        return []
    listed = _api_call("list recurring runs", lambda: client.list_recurring_runs(
        experiment_id=found.experiment_id, page_size=100, filter=_by_name(job_name)))
    deleted = [run.recurring_run_id for run in listed.recurring_runs or [] if run.display_name == job_name]
    for run_id in deleted:
        _api_call("delete the recurring run", lambda run_id=run_id: _delete_recurring_run(client, run_id))
    return deleted


def _delete_recurring_run(client, recurring_run_id: str) -> None:
    try:
        client.delete_recurring_run(recurring_run_id)
    except Exception as e:
        if getattr(e, "status", None) != 404:  # deleted meanwhile (another uninstall): what was wanted
            raise


def describe_backend(client, host: str | None) -> str:
    """One line on the KFP API `connect` checked: its release against the floor, and its mode."""
    health = _healthz(client)
    tag = health.get("tag_name")
    mode = "multi-user" if health.get("multi_user") is True else "single-user"
    version = f"version {tag}" if parse_kfp_version(tag) else f"version unknown ({tag!r})"
    return f"Kubeflow Pipelines API at {host or client._existing_config.host}: {version}, {mode}; fedpipe needs {MIN_KFP_BACKEND} or newer"


def backend_version(client) -> str | None:
    """The release the KFP API server reports (healthz tag_name) when it is one, else None: what a
    pipeline uploaded to it is compiled for (DeployOptions.kfp_version)."""
    tag = _healthz(client).get("tag_name")
    version = parse_kfp_version(tag)
    return ".".join(map(str, version)) if version else None
