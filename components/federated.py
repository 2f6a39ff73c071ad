"""The pipeline's tasks in federation mode (engine.mode=federation, a run parameter): each task submits one stage of
the run to the SuperLink (`fedpipe.federation.launch`) and waits for the ServerApp's answer in the run's store.

    config --> census --> phase 1 --> phase 2 --> ... --> evaluate --> publish

The census waits for the sites the config names (federation.sites / federation.site_names; a timeout names the
missing ones) and shows their split sizes and label counts; each phase task runs its phase's rounds at the sites
(no GPU here: the sites train) and forwards every finished round to the run's telemetry (the Pushgateway, MLflow,
as a simulated phase does; `clients` there is the number of sites that answered); the evaluate task has each site
score its models on its own splits and writes the run's report. A retried task submits its stage again: the
ServerApp resumes from its checkpoint in the store, so finished rounds are not run twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.run.report import render_html
from fedpipe.run.run import Run
from fedpipe.telemetry.events import PhaseEvent, RoundEvent
from fedpipe.telemetry.release import releasable_row

from . import bodies


def _run(config_path: str) -> Run:
    run = bodies._prepare(config_path)
    if run.cfg.engine.mode != "federation":
        raise ConfigError("a federation task was given a simulation config (engine.mode): the pipeline's branch and the config disagree")
    return run


def census(config_path: str, html_path: str) -> str:
    """Wait for the sites and take their census; returns their names, comma-separated."""
    from fedpipe.federation.launch import federate, submission
    from fedpipe.plots import census_heatmap

    run = _run(config_path)
    result = federate(run.cfg, stage="census")
    table = json.loads(submission(run.cfg).read("census.json") or b'{"sites": []}')  # bounded (federation.outputs.LIMITS)
    lines = [f"{len(table['sites'])} sites answered the census: {', '.join(map(str, result.get('names', [])))}"]
    images = {}
    if table["sites"] and table["sites"][0].get("counts"):  # with privacy on: the counts the sites released with noise
        path = Path(html_path).with_suffix(".png")
        images["census.png"] = census_heatmap(table, path).read_bytes()
        path.unlink()
    else:
        lines.append("The sites withheld their label counts (privacy.census_noise_multiplier unset, or their own policies).")
    Path(html_path).write_text(render_html(f"Census of {run.layout.run_id}", lines, images))
    return ",".join(map(str, result.get("names", [])))


class RoundForwarder:
    """Each round the ServerApp logged (rounds.jsonl in the store) that this task has not forwarded yet, as a
    RoundEvent to the run's sinks: the round log in the run's store, the Pushgateway, MLflow (with privacy on only
    what `fedpipe.telemetry.release` allows)."""

    def __init__(self, run: Run, phase: str, rounds: range):
        self.phase, self.order = phase, list(rounds)
        self.rounds = len(self.order)
        self.sinks = run.default_sinks(phase)
        self.labels = run.labels(phase)
        self.seen: set[int] = set()
        self.last: dict = {}
        self.first_round = None

    def __call__(self, submitted) -> None:
        data = submitted.read("rounds.jsonl") or b""
        for line in data.decode().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise CorruptArtifactError(f"{submitted.url}/rounds.jsonl holds a line that is not JSON ({e})") from None
            if row.get("phase") != self.phase or int(row["round"]) in self.seen:
                continue
            self.seen.add(int(row["round"]))
            if self.first_round is None:
                self.first_round = int(row["round"])
                for sink in self.sinks:
                    sink.phase_started(PhaseEvent(self.labels, self.rounds, self.first_round))
            seconds = float(row.get("seconds") or 0) or None
            event = RoundEvent(self.labels, int(row["round"]), self.order.index(int(row["round"])) + 1, self.rounds, int(row["clients"]), int(row["failed"]),
                               float(row["loss"]), None, None, int(row["bytes_up"]), int(row["bytes_down"]), seconds, None,
                               extra={"sites_answered": float(row["clients"]), **({"epsilon": float(row["privacy"]["epsilon"])}
                                                                                   if row.get("privacy") else {})})
            for sink in self.sinks:
                sink.round_finished(event)
            self.last = event.to_dict()

    def close(self) -> None:
        for sink in self.sinks:
            if self.first_round is not None:
                sink.phase_finished(PhaseEvent(self.labels, self.rounds, self.first_round, finished=True, seconds=None))
            sink.close()


def phase(config_path: str, phase_name: str, previous_path: str | None, state_path: str) -> dict:
    """One phase's rounds at the sites; writes the stage's result (phase, last round, sites) into `state_path`;
    returns the last round's figures (only the releasable ones with privacy on)."""
    from fedpipe.federation.launch import federate, site_count, submission
    from fedpipe.models.federated import warm_start_for

    run = _run(config_path)
    phases = run.phases()
    names = [p.name for p in phases]
    if phase_name not in names:
        raise ConfigError(f"method {run.cfg.method.name!r} has no phase {phase_name!r}; its phases are: {', '.join(names)}.")
    if names.index(phase_name) > 0 and previous_path is None:
        raise ConfigError(f"phase {phase_name!r} runs after phase {names[names.index(phase_name) - 1]!r}: give its state as input.")
    forward = RoundForwarder(run, phase_name, phases[names.index(phase_name)].rounds)
    warm = warm_start_for(run.cfg, site_count(run.cfg)) if names.index(phase_name) == 0 else None  # the first phase's start
    try:
        result = federate(run.cfg, stage=phase_name, on_poll=forward, warm_start=None if warm is None else warm[1],
                          warm_ledger=None if warm is None else warm[2])
    finally:
        forward.close()
    Path(state_path).parent.mkdir(parents=True, exist_ok=True)
    Path(state_path).write_text(json.dumps({**result, "store_url": submission(run.cfg).url}))
    last = forward.last or {"round": result.get("round", 0)}
    return releasable_row(last) if run.cfg.privacy.enabled else last


def evaluate(config_path: str, state_path: str, html_path: str, markdown_path: str) -> dict:
    """Each site scores its models on its own splits (and, with registry.name, the line's promoted global model on its
    held-out share: the gate's figures); the run's report. Returns the summary with the run id."""
    from fedpipe.federation.launch import federate, site_count
    from fedpipe.federation.report import summary_lines
    from fedpipe.models.federated import champion_for, note_champion

    run = _run(config_path)
    if not Path(state_path).is_file():
        raise ConfigError("the evaluate task needs the last phase's result as its input")
    champion = champion_for(run.cfg, site_count(run.cfg))
    note_champion(run.cfg, None if champion is None else champion[0])
    summary = federate(run.cfg, stage="evaluate", champion=None if champion is None else champion[1])
    lines = summary_lines(summary)
    images = {name: run.store.get(run.layout.report(name)) for name in ("census.png", "rounds.png")
              if run.store.exists(run.layout.report(name))}
    Path(html_path).write_text(render_html(summary["title"], lines, images))
    Path(markdown_path).write_text("\n".join(f"- {line}" for line in lines) + "\n")
    run.delete_pushed_metrics()  # the run is over, as a simulated run's evaluate ends it
    return {**summary, "run_id": run.layout.run_id}
