"""`fedpipe check`: what a run needs, checked from where the pipeline's pods run."""

from __future__ import annotations

from typing import Annotated

import typer

from fedpipe.cli.common import _guarded, app
from fedpipe.cli.deploy import HostOpt, NamespaceOpt, TokenFileOpt, TokenOpt
from fedpipe.errors import FedpipeError

check_app = typer.Typer(
    help="Check, from where the pipeline's pods run, what a run needs: the KFP API, the store, the Pushgateway "
         "(the Helm chart's `helm test` runs these). Each prints one line and exits 0, or says what failed and exits 2.",
    no_args_is_help=True,
)
app.add_typer(check_app, name="check")
CHECK_JOB = "fedpipe-check"  # the Pushgateway job of the check's group, apart from the runs' `fedpipe`


@check_app.command("kfp")
@_guarded
def check_kfp(host: HostOpt = None, namespace: NamespaceOpt = None, token: TokenOpt = None, token_file: TokenFileOpt = None):
    """The Kubeflow Pipelines API answers healthz with a release fedpipe's pipelines run on (the same check
    register, submit and schedule make first) and, on multi-user Kubeflow, a namespace is given."""
    from fedpipe.pipelines.client import connect, describe_backend

    typer.echo(describe_backend(connect(host, namespace, token, token_file), host))


@check_app.command("store")
@_guarded
def check_store(store: Annotated[str, typer.Option(help="The store the runs write to, e.g. s3://mlpipeline/fedpipe (FEDPIPE_S3_ENDPOINT and the AWS_* credentials from the environment, as in a task pod).")]):
    """Write one small object to the store, read it back and delete it, with the credentials a task pod gets."""
    import uuid

    from fedpipe.store import open_store

    opened = open_store(store)
    key = f"_fedpipe-check/{uuid.uuid4().hex}"
    payload = f"fedpipe check {key}".encode()
    opened.put(key, payload)
    try:
        back = opened.get(key)
    finally:
        opened.delete(key)
    if back != payload:
        raise FedpipeError(f"The store {opened.url()} gave back other bytes than were written to {opened.url(key)}.")
    typer.echo(f"store {opened.url()}: wrote, read back and deleted {opened.url(key)}")


@check_app.command("pushgateway")
@_guarded
def check_pushgateway(url: Annotated[str, typer.Option(help="The Pushgateway the runs push to, e.g. http://fedpipe-pushgateway.<namespace>:9091.")]):
    """Push one metric group the way a pipeline task does (prometheus_client), find it in the Pushgateway's
    /api/v1/metrics, and delete it."""
    import uuid

    from prometheus_client import CollectorRegistry, Gauge, delete_from_gateway, push_to_gateway

    from fedpipe.telemetry.prometheus import run_groups

    run_id = f"check-{uuid.uuid4().hex[:12]}"
    registry = CollectorRegistry()
    Gauge("fedpipe_check", "Pushed by `fedpipe check pushgateway`; deleted right away.", registry=registry).set(1)
    try:
        push_to_gateway(url, job=CHECK_JOB, registry=registry, grouping_key={"run_id": run_id}, timeout=10)
        found = run_groups(url, run_id, job=CHECK_JOB, timeout=10)
        delete_from_gateway(url, job=CHECK_JOB, grouping_key={"run_id": run_id}, timeout=10)
    except Exception as e:
        raise FedpipeError(
            f"The Pushgateway at {url} did not take a push: {type(e).__name__}: {str(e)[:300]}. Check the URL and that it "
            "runs; a 403 'RBAC: access denied' means Istio guards it (a sidecar on the Pushgateway pod, in a profile "
            "namespace): run it outside the mesh (the chart's pushgateway.podAnnotations) or allow the pushes.") from None
    if not found:
        raise FedpipeError(f"The Pushgateway at {url} accepted a push, but the group run_id={run_id} is not in its /api/v1/metrics.")
    typer.echo(f"Pushgateway at {url}: pushed, found and deleted the group job={CHECK_JOB} run_id={run_id}")
