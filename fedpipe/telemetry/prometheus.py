"""Telemetry sink that pushes each round's metrics to a Prometheus Pushgateway.

Every push replaces one Pushgateway *group*, keyed by ``job`` (default ``fedpipe``) and the run's
labels ``run_id``, ``pipeline``, ``method``, ``phase`` and ``dataset``. Prometheus scrapes the
Pushgateway (with ``honor_labels: true``) and so sees these as labels of every series. There are
no per-client labels, so the number of series stays bounded: one group per run and phase.

Metrics (all gauges; each group holds the latest value):

==================================== ==============================================================
``fedpipe_round``                     global round index (1-based, continues across phases)
``fedpipe_phase_round``               round index within the phase (1-based)
``fedpipe_phase_rounds``              rounds in the phase
``fedpipe_train_loss``                sample-weighted mean training loss of the round's clients
``fedpipe_personalized_accuracy``     mean accuracy of the clients on their own test split (0..1);
                                      only pushed on rounds that evaluated it
``fedpipe_global_accuracy``           global model top-1 accuracy on the global test set (0..1);
                                      only pushed on rounds that evaluated it
``fedpipe_bytes_uploaded``            bytes sent client -> server in the round
``fedpipe_bytes_downloaded``          bytes sent server -> client in the round
``fedpipe_bytes_uploaded_total``      bytes sent client -> server since the phase started (in this
                                      process; a resumed phase starts again from 0)
``fedpipe_bytes_downloaded_total``    bytes sent server -> client since the phase started (idem)
``fedpipe_round_seconds``             wall time of the round (training + aggregation)
``fedpipe_samples_per_second``        training samples processed per second of the round
``fedpipe_clients``                   clients that reported back in the round
``fedpipe_failed_clients``            clients sampled but left out of aggregation in the round
``fedpipe_extra{name=...}``           method-specific scalars of the round (`RoundEvent.extra`)
``fedpipe_phase_finished``            0 while the phase runs, 1 once it finished
``fedpipe_phase_seconds``             wall time of the finished phase
==================================== ==============================================================

A gauge whose value the event does not carry (None) is not pushed: an accuracy on a round that did not evaluate
it, and with privacy on every figure `fedpipe.telemetry.release` withholds (the sink then gets only what that
allowlist releases: the round indices, the accuracies, epsilon, delta and the clip).

Example queries: ``fedpipe_personalized_accuracy{run_id="run-1"}``,
``sum by (run_id) (fedpipe_bytes_uploaded_total)`` (traffic of a run over all its phases).

If the Pushgateway cannot be reached, training goes on: the sink logs ONE warning (which URL, that
metrics are not being pushed), counts every failed or skipped push in `lost_pushes`, and after a
failure only tries again every `retry_interval` seconds, so an unreachable gateway costs at most one
`timeout` per interval. It never raises.

A finished run removes its groups: when its evaluation has finished, `delete_run_groups` deletes
every group of the run's ``run_id`` (all its phases, whichever pod pushed them, an earlier attempt's
too), found through the Pushgateway's ``/api/v1/metrics``. It first waits until the run's newest push
is ``telemetry.pushgateway_retention_seconds`` old (default 60 s, four scrapes at 15 s), so Prometheus
has scraped the final values. Prometheus keeps the history in its TSDB and marks the deleted series
stale: queries over time still show the run, the dashboard no longer shows it as live. An unreachable
gateway costs one warning; the run still succeeds.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, delete_from_gateway, push_to_gateway

from fedpipe.config import refuse_url_credentials
from fedpipe.errors import ConfigError
from fedpipe.telemetry.events import PhaseEvent, RoundEvent, RunLabels

__all__ = ["ENV_PUSHGATEWAY", "METRICS", "PrometheusSink", "delete_run_groups", "run_groups"]

log = logging.getLogger(__name__)

ENV_PUSHGATEWAY = "FEDPIPE_PUSHGATEWAY"

#: Metric name -> help text (what is pushed; see the module docstring).
METRICS: dict[str, str] = {
    "fedpipe_round": "Global round index (1-based, continues across phases).",
    "fedpipe_phase_round": "Round index within the phase (1-based).",
    "fedpipe_phase_rounds": "Number of rounds in the phase.",
    "fedpipe_train_loss": "Sample-weighted mean training loss over the round's clients.",
    "fedpipe_personalized_accuracy": "Mean accuracy of the clients on their own test split (0..1).",
    "fedpipe_global_accuracy": "Global model top-1 accuracy on the global test set (0..1).",
    "fedpipe_bytes_uploaded": "Bytes sent from clients to the server in the round.",
    "fedpipe_bytes_downloaded": "Bytes sent from the server to clients in the round.",
    "fedpipe_bytes_uploaded_total": "Bytes sent from clients to the server since the phase started.",
    "fedpipe_bytes_downloaded_total": "Bytes sent from the server to clients since the phase started.",
    "fedpipe_round_seconds": "Wall time of the round in seconds (training and aggregation).",
    "fedpipe_samples_per_second": "Training samples processed per second of the round.",
    "fedpipe_clients": "Clients that reported back in the round.",
    "fedpipe_failed_clients": "Clients sampled but left out of aggregation in the round.",
    "fedpipe_extra": "Method-specific scalar of the round, by name.",
    "fedpipe_phase_finished": "1 once the phase finished, 0 while it runs.",
    "fedpipe_phase_seconds": "Wall time of the finished phase in seconds.",
}

_LABEL_NAMES = ("run_id", "pipeline", "method", "phase", "dataset")


class _Group:
    """The metrics of one Pushgateway group (one run phase), in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges: dict[str, Gauge] = {}
        self.extra: Gauge | None = None
        self.uploaded_total = 0
        self.downloaded_total = 0

    def set(self, name: str, value: float | int | None) -> None:
        if value is None:
            return  # not evaluated this round, or withheld: keep the last value; never push a made-up 0
        gauge = self.gauges.get(name)
        if gauge is None:
            gauge = Gauge(name, METRICS[name], registry=self.registry)
            self.gauges[name] = gauge
        gauge.set(float(value))

    def add_totals(self, uploaded: int | None, downloaded: int | None) -> None:
        """The phase's running byte totals; a round's bytes withheld (None, privacy on) leave them unpushed."""
        if uploaded is not None:
            self.uploaded_total += int(uploaded)
            self.set("fedpipe_bytes_uploaded_total", self.uploaded_total)
        if downloaded is not None:
            self.downloaded_total += int(downloaded)
            self.set("fedpipe_bytes_downloaded_total", self.downloaded_total)

    def set_extra(self, name: str, value: float) -> None:
        if self.extra is None:
            self.extra = Gauge("fedpipe_extra", METRICS["fedpipe_extra"], ["name"], registry=self.registry)
        self.extra.labels(name=str(name)).set(float(value))


class PrometheusSink:
    """Pushes `RoundEvent`s and phase ends to a Pushgateway; implements the telemetry `Sink`."""

    def __init__(
        self,
        gateway_url: str,
        job: str = "fedpipe",
        timeout: float = 2.0,
        retry_interval: float = 30.0,
    ):
        if not gateway_url or not str(gateway_url).strip():
            raise ValueError("PrometheusSink needs the Pushgateway URL, e.g. http://pushgateway:9091")
        self.gateway_url = _normalized(gateway_url)
        self.job = job
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.lost_pushes = 0
        self.pushes = 0
        self._groups: dict[RunLabels, _Group] = {}
        self._warned = False
        self._failing_since: float | None = None
        self._last_attempt = 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, job: str = "fedpipe", **kwargs) -> PrometheusSink | None:
        """A sink for the gateway in FEDPIPE_PUSHGATEWAY, or None when that is unset or empty."""
        url = os.environ.get(ENV_PUSHGATEWAY, "").strip()
        return cls(url, job=job, **kwargs) if url else None

    def __repr__(self) -> str:
        return f"PrometheusSink({self.gateway_url!r}, job={self.job!r})"

    # -- Sink protocol -------------------------------------------------------------------------

    def phase_started(self, event: PhaseEvent) -> None:
        try:
            group = self._group(event.labels)
            group.set("fedpipe_phase_finished", 0)
            group.set("fedpipe_phase_rounds", event.total_rounds)
            self._push(event.labels, group)
        except Exception as exc:  # a sink never raises into training
            self._failed(exc)

    def round_finished(self, event: RoundEvent) -> None:
        try:
            group = self._group(event.labels)
            group.add_totals(event.bytes_uploaded, event.bytes_downloaded)
            group.set("fedpipe_round", event.round)
            group.set("fedpipe_phase_round", event.phase_round)
            group.set("fedpipe_phase_rounds", event.phase_rounds)
            group.set("fedpipe_train_loss", event.train_loss)
            group.set("fedpipe_personalized_accuracy", event.personalized_accuracy)
            group.set("fedpipe_global_accuracy", event.global_accuracy)
            group.set("fedpipe_bytes_uploaded", event.bytes_uploaded)
            group.set("fedpipe_bytes_downloaded", event.bytes_downloaded)
            group.set("fedpipe_round_seconds", event.seconds)
            group.set("fedpipe_samples_per_second", event.samples_per_second)
            group.set("fedpipe_clients", event.clients)
            group.set("fedpipe_failed_clients", event.failed_clients)
            for name, value in (event.extra or {}).items():
                if value is not None:
                    group.set_extra(name, value)
            self._push(event.labels, group)
        except Exception as exc:
            self._failed(exc)

    def phase_finished(self, event: PhaseEvent) -> None:
        try:
            group = self._group(event.labels)
            group.set("fedpipe_phase_finished", 1)
            group.set("fedpipe_phase_seconds", event.seconds)
            self._push(event.labels, group)
        except Exception as exc:
            self._failed(exc)

    def close(self) -> None:
        if self.lost_pushes:
            log.info(
                "%d of %d metric pushes to the Prometheus Pushgateway at %s were lost.",
                self.lost_pushes,
                self.lost_pushes + self.pushes,
                self.gateway_url,
            )

    # -- internals -----------------------------------------------------------------------------

    def _group(self, labels: RunLabels) -> _Group:
        group = self._groups.get(labels)
        if group is None:
            group = self._groups[labels] = _Group()
        return group

    @staticmethod
    def grouping_key(labels: RunLabels) -> dict[str, str]:
        return {name: str(getattr(labels, name)) for name in _LABEL_NAMES}

    def _push(self, labels: RunLabels, group: _Group) -> None:
        with self._lock:
            now = time.monotonic()
            if self._failing_since is not None and now - self._last_attempt < self.retry_interval:
                self.lost_pushes += 1  # gateway known to be down: skip instead of waiting again
                return
            self._last_attempt = now
            try:
                push_to_gateway(
                    self.gateway_url,
                    job=self.job,
                    registry=group.registry,
                    grouping_key=self.grouping_key(labels),
                    timeout=self.timeout,
                )
            except Exception as exc:
                self._failed(exc, locked=True)
                return
            self.pushes += 1
            if self._failing_since is not None:
                log.info(
                    "Metrics are being pushed again to the Prometheus Pushgateway at %s "
                    "(%d pushes were lost).",
                    self.gateway_url,
                    self.lost_pushes,
                )
                self._failing_since = None

    def _failed(self, exc: BaseException, locked: bool = False) -> None:
        if not locked:
            with self._lock:
                return self._failed(exc, locked=True)
        self.lost_pushes += 1
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        reason = _reason(exc)
        if not self._warned:
            self._warned = True
            log.warning(
                "Could not push metrics to the Prometheus Pushgateway at %s (%s); training goes on, "
                "but metrics are not being pushed. Check the Pushgateway URL (%s or the run config) "
                "and that the gateway is running; fedpipe retries every %g s and counts the lost "
                "pushes.",
                self.gateway_url,
                reason,
                ENV_PUSHGATEWAY,
                self.retry_interval,
            )
        else:
            log.debug("Metric push to %s failed again: %s", self.gateway_url, reason)


def run_groups(gateway_url: str, run_id: str, job: str = "fedpipe", timeout: float = 5.0) -> list[tuple[dict[str, str], float]]:
    """The Pushgateway's groups of run `run_id` under `job`: (grouping key without ``job``, Unix time
    of the group's last successful push) each, read from ``GET /api/v1/metrics``. Raises on HTTP or
    connection errors."""
    url = _normalized(gateway_url) + "/api/v1/metrics"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "application/json"}), timeout=timeout) as resp:
        body = json.load(resp)
    found = []
    for group in body.get("data") or []:
        labels = dict(group.get("labels") or {})
        if labels.get("job") != job or labels.get("run_id") != run_id:
            continue
        del labels["job"]
        pushed = 0.0
        for sample in (group.get("push_time_seconds") or {}).get("metrics") or []:
            try:
                pushed = max(pushed, float(sample.get("value", 0)))
            except (TypeError, ValueError):
                pass
        found.append((labels, pushed))
    return found


def delete_run_groups(
    gateway_url: str,
    run_id: str,
    *,
    job: str = "fedpipe",
    retention_seconds: float = 60.0,
    timeout: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> list[dict[str, str]] | None:
    """Delete every Pushgateway group of a finished run (every phase and pipeline label of `run_id`
    under `job`, whichever process pushed it), once the run's newest push is `retention_seconds` old.

    The wait lets Prometheus scrape the final values before they go. The groups are read again after
    it, so a group pushed meanwhile is waited for too (at most three waits); a push time ahead of this
    machine's clock makes it wait `retention_seconds`, never longer. Logs one line naming what was
    deleted. Returns the deleted groups' grouping keys (without ``job``); None when the Pushgateway could
    not be read or a deletion failed: then it logs ONE warning and never raises (a run never fails on metrics).
    """
    url = "the Pushgateway"  # named in the warning once it is known to hold no credentials
    deleted: list[dict[str, str]] = []
    waited_for: float | None = None  # the newest push time already waited for
    try:
        url = _normalized(gateway_url)
        for attempt in range(4):
            groups = run_groups(url, run_id, job=job, timeout=timeout)
            if not groups:
                break
            newest = max(pushed for _, pushed in groups)
            wait = min(float(retention_seconds), float(retention_seconds) - (clock() - newest))
            if wait > 0 and newest != waited_for and attempt < 3:
                waited_for = newest
                log.info(
                    "Waiting %.1f s before deleting the metrics of run %s from the Pushgateway at %s, so "
                    "Prometheus scrapes their final values (telemetry.pushgateway_retention_seconds=%g).",
                    wait, run_id, url, retention_seconds,
                )
                sleep(wait)
                continue
            for key, _ in groups:
                delete_from_gateway(url, job=job, grouping_key=key, timeout=timeout)
                deleted.append(key)
            break
    except Exception as exc:  # never fail a finished run over its metrics
        log.warning(
            "Could not delete the metrics of run %s from the Prometheus Pushgateway at %s (%s); the run "
            "is finished, but its metric groups stay on the gateway (and their last values on the "
            "dashboard) until deleted there%s.",
            run_id, url, _reason(exc), f" ({len(deleted)} were deleted before the failure)" if deleted else "",
        )
        return None
    if deleted:
        phases = sorted({key.get("phase", "") for key in deleted})
        log.info(
            "Deleted %d metric group%s of run %s (job %s; phases %s) from the Pushgateway at %s.",
            len(deleted), "" if len(deleted) == 1 else "s", run_id, job, ", ".join(phases), url,
        )
    else:
        log.info("The Pushgateway at %s holds no metrics of run %s; nothing to delete.", url, run_id)
    return deleted


def _normalized(gateway_url: str) -> str:
    """The URL with a scheme; ConfigError when it holds credentials (it is logged in every warning)."""
    url = str(gateway_url).strip().rstrip("/")
    try:
        refuse_url_credentials(url, f"The Pushgateway URL (telemetry.pushgateway or env {ENV_PUSHGATEWAY})",
                               "a Pushgateway that needs authentication is reached through a proxy or a service mesh "
                               "(an Istio sidecar) that adds it, never through the URL.")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return url if "://" in url else "http://" + url


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    text = str(reason if reason is not None else exc).strip()
    return (text or type(exc).__name__)[:200]
