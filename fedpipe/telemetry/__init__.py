"""Telemetry: one call per event, fanned out to sinks (JSONL in the store, progress bar, Prometheus)."""

from __future__ import annotations

from typing import Protocol

from fedpipe.telemetry.events import PhaseEvent, RoundEvent, RunLabels

__all__ = ["PhaseEvent", "RoundEvent", "RunLabels", "Sink", "Telemetry"]


class Sink(Protocol):
    """Receives events. A sink must never raise into training: it degrades and says so once."""

    def phase_started(self, event: PhaseEvent) -> None: ...

    def round_finished(self, event: RoundEvent) -> None: ...

    def phase_finished(self, event: PhaseEvent) -> None: ...

    def close(self) -> None: ...


class Telemetry:
    """Fans each event out to every sink."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)

    def phase_started(self, event: PhaseEvent) -> None:
        for sink in self.sinks:
            sink.phase_started(event)

    def round_finished(self, event: RoundEvent) -> None:
        for sink in self.sinks:
            sink.round_finished(event)

    def phase_finished(self, event: PhaseEvent) -> None:
        for sink in self.sinks:
            sink.phase_finished(event)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
