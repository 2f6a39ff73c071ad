"""A TrainJob's progress in Kubeflow Trainer (v2.2+, `status.trainerStatus`) from fedpipe's rounds.

When a distributed phase runs as a Trainer v2 TrainJob and the cluster's Trainer has the alpha feature gate
`TrainJobStatus` on, Trainer's `TrainJobStatus` plugin (kubeflow/trainer v2.2.0,
pkg/runtime/framework/plugins/trainjobstatus) gives every trainer container

- ``KUBEFLOW_TRAINER_SERVER_URL``: its status server's endpoint for this TrainJob,
  ``https://<service>.<namespace>.svc:<port>/apis/trainer.kubeflow.org/v1alpha1/namespaces/<ns>/trainjobs/<name>/status``;
- ``KUBEFLOW_TRAINER_SERVER_CA_CERT``: the path of the CA that signs that server's certificate;
- ``KUBEFLOW_TRAINER_SERVER_TOKEN``: the path of a projected service-account token whose audience is that
  TrainJob (pkg/statusserver/auth.go checks it by OIDC: no Role or RoleBinding is needed, and the token is
  good for that one TrainJob only; it rotates, so it is read again for every update).

Rank 0 then POSTs an ``UpdateTrainJobStatusRequest`` (trainjob_types.go):
``{"trainerStatus": {"progressPercentage", "estimatedRemainingSeconds", "metrics": [{"name", "value"}],
"lastUpdatedTime"}}``; the server applies it to the TrainJob's status (`kubectl get trainjob` shows it).
Progress is the phase's rounds done over its rounds; the estimate is the phase's mean wall time per round
(since it started or resumed) times the rounds left; the metrics are the round's train_loss and, on
evaluated rounds, personalized_accuracy and global_accuracy (values as text, as the API wants). With privacy on
the sink gets what `fedpipe.telemetry.release` allows: no train_loss and no time estimate. At most one
update every MIN_INTERVAL_S seconds, and always the phase's last round. Without the variables (gate off, a
PyTorchJob, the pipeline's own task) no sink is made. A refused or unreachable server costs one warning;
training never waits on it beyond TIMEOUT_S.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime

from fedpipe.telemetry.events import PhaseEvent, RoundEvent

log = logging.getLogger(__name__)

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"  # noqa: S105 (a variable's name)
MIN_INTERVAL_S = 10.0
TIMEOUT_S = 5.0
MAX_TOKEN_BYTES = 64 * 1024
MAX_TEXT = 64  # a metric's name and value (the CRD's maxLength)


def metric_text(value: float) -> str:
    return f"{value:.6g}"


class TrainerStatusSink:
    """A telemetry sink that reports the phase's progress to Trainer's status server (see the module)."""

    def __init__(self, url: str, ca_file: str, token_file: str, *, clock: Callable[[], float] = time.monotonic,
                 min_interval: float = MIN_INTERVAL_S):
        self.url, self.ca_file, self.token_file = url, ca_file, token_file
        self.clock, self.min_interval = clock, min_interval
        self._started: float | None = None
        self._first_round = 1
        self._last_sent: float | None = None
        self._warned = False
        self.sent = 0

    @classmethod
    def from_env(cls) -> TrainerStatusSink | None:
        """The sink when Trainer injected its variables (feature gate TrainJobStatus on); else None."""
        url = os.environ.get(ENV_URL, "").strip()
        if not url:
            return None
        return cls(url, os.environ.get(ENV_CA, "").strip(), os.environ.get(ENV_TOKEN, "").strip(), min_interval=MIN_INTERVAL_S)

    def phase_started(self, event: PhaseEvent) -> None:
        self._started, self._first_round, self._last_sent = self.clock(), event.first_round, None

    def round_finished(self, event: RoundEvent) -> None:
        now = self.clock()
        last = event.phase_round >= event.phase_rounds
        if not last and self._last_sent is not None and now - self._last_sent < self.min_interval:
            return
        self._last_sent = now
        self.post(self.payload(event, now))

    def phase_finished(self, event: PhaseEvent) -> None: ...

    def close(self) -> None: ...

    def payload(self, event: RoundEvent, now: float) -> dict:
        """The UpdateTrainJobStatusRequest for `event` (rounds counted within the phase)."""
        done, total = event.phase_round, max(event.phase_rounds, 1)
        status: dict = {"progressPercentage": min(100, max(0, (100 * done) // total))}
        ran = event.round - self._first_round + 1  # rounds since the phase started or resumed
        # seconds None: the round's time is withheld (privacy on, `fedpipe.telemetry.release`), so is an estimate
        # made from it
        if self._started is not None and ran > 0 and event.seconds is not None:
            per_round = (now - self._started) / ran
            status["estimatedRemainingSeconds"] = max(0, min(2**31 - 1, round(per_round * (total - done))))
        metrics = {"train_loss": event.train_loss, "personalized_accuracy": event.personalized_accuracy,
                   "global_accuracy": event.global_accuracy, "round": event.round}
        status["metrics"] = [{"name": k, "value": metric_text(v)[:MAX_TEXT]} for k, v in metrics.items() if v is not None]
        status["lastUpdatedTime"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # metav1.Time: RFC 3339, seconds
        return {"trainerStatus": status}

    def _token(self) -> str:
        with open(self.token_file, "rb") as f:
            return f.read(MAX_TOKEN_BYTES).decode("utf-8", "replace").strip()

    def post(self, body: dict) -> bool:
        """One update; False (and one warning per sink) when it did not land. Never raises."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
            request = urllib.request.Request(self.url, json.dumps(body).encode(), method="POST", headers={
                "Authorization": f"Bearer {self._token()}", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as answer:  # noqa: S310 (https from Trainer)
                answer.read(4096)
            self.sent += 1
            return True
        except urllib.error.HTTPError as e:
            reason = f"HTTP {e.code} {e.read(300).decode('utf-8', 'replace')}"
        except (OSError, ValueError, ssl.SSLError) as e:
            reason = f"{type(e).__name__}: {e}"
        if not self._warned:
            self._warned = True
            log.warning("The TrainJob's progress could not be reported to Kubeflow Trainer at %s (%s); training goes on "
                        "without it (this warning is given once).", self.url, reason[:300])
        return False
