"""What training reports: one event per finished round, one per phase start and end.

Sinks (JSONL file, progress bar, Prometheus Pushgateway, MLflow, Kubeflow Trainer) receive these and nothing
else; algorithms never print. With privacy on, a sink outside the trusted server receives a round's event
through `fedpipe.telemetry.release`, which sets the figures it withholds to None.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RunLabels:
    """Identifies a run's series; these become Prometheus labels, so each has few values."""

    run_id: str
    pipeline: str  # the pipeline (or "local" for the CLI) that runs the method
    method: str
    phase: str
    dataset: str


@dataclass(frozen=True)
class RoundEvent:
    """One finished round of one phase."""

    labels: RunLabels
    round: int  # global round index (1-based, continues across phases)
    phase_round: int  # 1-based index within the phase
    phase_rounds: int  # rounds in the phase
    # clients, failed_clients, train_loss, bytes_*, seconds, samples_per_second: None when withheld from a sink
    # outside the trusted server (privacy on, `fedpipe.telemetry.release`)
    clients: int | None  # clients that took part (reported back)
    failed_clients: int | None  # clients sampled but left out of aggregation
    train_loss: float | None  # sample-weighted mean training loss over the round's clients
    personalized_accuracy: float | None  # mean over clients on their own test split (None: not evaluated)
    global_accuracy: float | None  # global model top-1 on the global test set (None: not evaluated / none)
    bytes_uploaded: int | None  # client -> server, this round
    bytes_downloaded: int | None  # server -> client, this round
    seconds: float | None  # wall time of the round (training + aggregation, evaluation excluded)
    samples_per_second: float | None  # training samples processed per second of `seconds`
    extra: dict[str, float] = field(default_factory=dict)  # method-specific scalars (also pushed as metrics)
    details: dict = field(default_factory=dict)  # method-specific records (e.g. pFedMB's alphas): JSONL only

    def to_dict(self) -> dict:
        d = asdict(self)
        labels = d.pop("labels")
        return {**labels, **d}


@dataclass(frozen=True)
class PhaseEvent:
    """A phase started (finished=False) or ended (finished=True)."""

    labels: RunLabels
    total_rounds: int
    first_round: int  # global index of the phase's first round still to run (after a resume)
    finished: bool = False
    seconds: float | None = 0.0  # None: withheld (privacy on, `fedpipe.telemetry.release`)
