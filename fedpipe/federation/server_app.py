"""fedpipe's ServerApp: the phase task's side of a federation, run by the SuperLink for each `flwr run`.

Flower 1.42 API used: `ServerApp()` with `@app.main()` taking `(grid: Grid, context: Context)`
(flwr/serverapp/server_app.py); `grid.get_node_ids()` lists the SuperNodes connected now and
`grid.send_and_receive(messages, timeout=...)` pushes messages and pulls the replies that arrive in time
(flwr/serverapp/grid/grid.py); `Message(content, dst_node_id=..., message_type=..., group_id=...)`
(flwr/app/message/message.py). The run config (`context.run_config`) comes from the FAB's
[tool.flwr.app.config] and `flwr run --run-config` overrides.

The rounds are `fedpipe.engine.rounds.run_phase`, the simulation's own loop: the same client selection,
`algorithm.download`, `algorithm.aggregate` and learning-rate schedule. Only the `RoundTrainer` differs:
`SiteRound` sends each chosen client's download to the site that holds it and turns each reply into a
`ClientOutcome` after `check_upload`; a rejected or missing upload becomes a failed client (named in the
log and in rounds.jsonl), which `run_round` leaves out while the round goes on (`train.min_clients`).
With `federation.secure_aggregation.enabled` the trainer is `fedpipe.federation.secagg.SecureSiteRound` instead
(SecAgg+: the server gets the round's weighted mean, never an upload); the plain path is this module's `SiteRound`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

import safetensors.torch
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import http_grid

from fedpipe.algorithms.base import Algorithm, Phase, ServerState
from fedpipe.engine.accounting import Ledger, default_delta
from fedpipe.engine.clients import ClientOutcome, ClientWork
from fedpipe.engine.privacy import Privacy
from fedpipe.engine.rounds import RoundResult, run_phase
from fedpipe.engine.sequential import ClientStats
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError
from fedpipe.federation import audit, places, resume
from fedpipe.federation.census import (
    Census,
    CensusError,
    ClaimRefused,
    Samples,
    read_answer,
    take_census,
    vouched_samples,
    vouched_scores,
)
from fedpipe.federation.outputs import ServerOutputs
from fedpipe.federation.private import census_release, server_privacy
from fedpipe.federation.spec import FederationSpec
from fedpipe.federation.supernode import quick_pulls
from fedpipe.federation.transport import POLL, UploadRejected, check_upload, record_bytes, to_record

log = logging.getLogger(__name__)
app = ServerApp()
# the replies' content is pulled with a short backoff, not Flower's 1 s (`fedpipe.federation.supernode.quick_pulls`;
# the ServerApp's grid is flwr/superlink/grid/http_grid.py's)
quick_pulls(http_grid)
DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class SiteEntry:
    """What the server knows of a client: its id, whether it opted out, and the Flower node that holds it."""

    client_id: int
    opt_out: bool
    node_id: int
    samples: Samples | None = None  # the census's counts: what the server weighs this site's replies by


class Roster:
    """The clients as `fedpipe.engine.rounds.select_clients` reads them (`clients`, `num_clients`): ids and
    opt-out flags only; their data stays at the sites."""

    def __init__(self, entries: list[SiteEntry]):
        self.clients = tuple(sorted(entries, key=lambda e: e.client_id))
        self.by_id = {e.client_id: e for e in self.clients}

    @property
    def num_clients(self) -> int:
        return len(self.clients)


def wait_for_sites(grid: Grid, expected: int, timeout: float, spec: FederationSpec | None = None,
                   names: tuple[str, ...] = ()) -> tuple[Roster, FederationSpec | None, Census]:
    """Wait until `expected` SuperNodes are connected (with `names`, federation.site_names: until the census has heard
    from each named site; other sites are left out), then take the census (`fedpipe.federation.census`): each site
    says which client it holds or, with its own files, what it holds; own-files sites are then told their client ids
    ("assign", under the spec completed with the data's shape) and the completed spec is returned. The timeout's
    error names the sites that did not answer."""
    deadline = time.monotonic() + timeout
    # the spec goes to every site: each checks the run against its own policy before it answers (fedpipe.federation.policy)
    ask = {"what": "identity", **({"spec": spec.to_json()} if spec is not None else {})}
    answers: list[tuple[int, dict]] = []
    refusals: dict[int, str] = {}
    heard: tuple[int, ...] = ()
    while True:
        nodes = tuple(sorted(grid.get_node_ids()))
        if nodes != heard and (len(nodes) >= expected or time.monotonic() >= deadline):
            refusals.clear()
            answers, heard = _identities(grid, nodes, ask, max(deadline - time.monotonic(), 5.0), refusals), nodes
            if names:
                answers = _named(answers, names)
            if len(answers) >= expected and (not names or len(answers) == len(names)):
                break
            if refusals and len(answers) + len(refusals) == len(nodes):  # every connected site spoke; a policy does not change
                raise ConfigError(f"only {len(answers)} of the {expected} sites the run needs take it; {'; '.join(refusals.values())}. "
                                  "Change the run to fit their policies (each site's `fedpipe site check` prints its own), "
                                  "or ask those sites to change theirs")
        if time.monotonic() >= deadline:
            have = sorted(_name_of(a) for _, a in answers)
            missing = f"; missing: {', '.join(sorted(set(names) - set(have)))}" if names else ""
            refused = f"; {'; '.join(refusals.values())}" if refusals else ""
            raise TimeoutError(f"only {len(answers)} of {expected} sites answered within {timeout:.0f}s (answered: "
                               f"{', '.join(have) or 'none'}{missing}{refused}): start the missing sites (`fedpipe site join`, "
                               "or the fedpipe-site chart) and check their logs, or raise federation.connect_timeout")
        time.sleep(0.5)
    census = replace(take_census(answers), refused=tuple(refusals.values()))
    for refusal in census.refused:
        log.warning("Census: %s", refusal)
    if census.input_shape is not None and spec is not None:
        spec = spec.with_data(census.input_shape, census.num_classes)
        assigns = [Message(RecordDict({"ask": ConfigRecord({"what": "assign", "spec": spec.to_json(), "client-id": s.client_id})}),
                           dst_node_id=s.node_id, message_type=MessageType.QUERY) for s in census.sites]
        replies = exchange(grid, assigns, timeout)
        missing = [s.name for s in census.sites if s.node_id not in replies or replies[s.node_id].has_error()]
        if missing:
            raise TimeoutError(f"site(s) {missing} did not take their client id within {timeout:.0f}s")
    return Roster([SiteEntry(s.client_id, s.opt_out, s.node_id, s.samples) for s in census.sites]), spec, census


def _identities(grid: Grid, nodes: tuple[int, ...], ask: dict, timeout: float,
                refusals: dict[int, str] | None = None) -> list[tuple[int, dict]]:
    """Each connected site's census answer (those that answered within `timeout`); a site's error reply (a refusal
    under its own policy among them) goes into `refusals` by node."""
    answers = []
    for node, reply in exchange(grid, [Message(RecordDict({"ask": ConfigRecord(ask)}), dst_node_id=n, message_type=MessageType.QUERY)
                                       for n in nodes], timeout).items():
        if reply.has_error():
            log.warning("Site on node %s did not answer the census: %s", node, reply.error.reason)
            if refusals is not None:
                refusals[node] = str(reply.error.reason)
            continue
        try:  # bounded and typed before anything in it is used; a malformed answer is that site's refusal
            answers.append((node, read_answer(node, reply.content.config_records.get("site") or {})))
        except CensusError as e:
            log.warning("Census: %s", e)
            if refusals is not None:
                refusals[node] = str(e)
    return answers


def _name_of(answer: dict) -> str:
    return str(answer["census"]["name"]) if answer.get("census") else f"site-{answer['client-id']}"


def _named(answers: list[tuple[int, dict]], names: tuple[str, ...]) -> list[tuple[int, dict]]:
    """The answers of the sites federation.site_names names; any other site is left out of the run (and logged)."""
    kept = [(node, a) for node, a in answers if _name_of(a) in names]
    for node, a in answers:
        if _name_of(a) not in names:
            log.warning("Site %r (node %s) is not in federation.site_names: it is left out of this run", _name_of(a), node)
    return kept


class SiteRound:
    """A `RoundTrainer` (fedpipe.engine.rounds) whose clients train at their sites."""

    def __init__(self, grid: Grid, roster: Roster, spec: FederationSpec, phase: Phase, timeout: float, log_path: Path,
                 rejoin_wait: float = 0.0, algorithm: Algorithm | None = None):
        self.grid, self.roster, self.phase, self.timeout, self.log_path = grid, roster, phase, timeout, log_path
        self.rejoin_wait = rejoin_wait
        self.algorithm = algorithm  # whose `upload_layout` each upload is checked against (None: the download's layout)
        self.spec_json = spec.to_json()
        self.rejected: list[dict] = []
        self.reports: dict[int, dict[int, dict]] = {}  # round -> client -> what its site reported (metrics)
        self.privacy: Privacy | None = None  # the phase's Privacy at the server (`fedpipe.federation.private`), set by serve

    def online(self, nodes: set[int]) -> set[int]:
        """Which of `nodes` the SuperLink has online, waiting up to `rejoin_wait` seconds for the others (a site
        restarting after a crash; Flower keeps a SIGKILLed SuperNode's node online until it misses its heartbeats,
        up to 2 x 30 s, and only then lets the restarted one activate under the same key and node id)."""
        deadline = time.monotonic() + self.rejoin_wait
        while True:
            up = nodes & set(self.grid.get_node_ids())
            if up == nodes or time.monotonic() >= deadline:
                return up
            time.sleep(1.0)

    def __call__(self, round_: int, lr: float, works: list[ClientWork]) -> tuple[list[ClientOutcome], None]:
        # with privacy the sites clip with the server's current clip (adaptive clipping moves it round by round)
        clip = {"privacy-clip": float(self.privacy.clip)} if self.privacy is not None else {}
        config = ConfigRecord({"spec": self.spec_json, "phase": self.phase.name, "round": round_, "lr": float(lr), **clip})
        messages, by_node = [], {}
        for w in works:
            by_node[self.roster.by_id[w.client_id].node_id] = w
        up = self.online(set(by_node))
        for node, w in by_node.items():
            if node in up:  # a phase whose clients download nothing (Local) sends none: the site starts from the run's model
                download = to_record(w.download if self.phase.downloads else {})
                messages.append(Message(RecordDict({"download": download, "config": config}), dst_node_id=node,
                                        message_type=MessageType.TRAIN, group_id=f"{self.phase.name}-{round_}"))
        replies = exchange(self.grid, messages, self.timeout)
        outcomes = []
        for node, w in by_node.items():
            if node not in up:
                outcomes.append(self._reject(w.client_id, round_, 0, f"SiteOffline: site {w.client_id} (node {node}) was not "
                                             f"connected at the round's start (waited {self.rejoin_wait:.0f}s for it to rejoin)"))
            else:
                outcomes.append(self._outcome(w, node, replies.get(node), round_))
        return outcomes, None

    def _outcome(self, work: ClientWork, node: int, reply: Message | None, round_: int) -> ClientOutcome:
        cid, site = work.client_id, f"site {work.client_id} (node {node})"
        if reply is None:
            return self._reject(cid, round_, 0, f"SiteTimeout: {site} sent no reply within {self.timeout:.0f}s")
        if reply.has_error():
            return self._reject(cid, round_, 0, f"SiteError: {site}: {reply.error.reason}")
        content = reply.content
        metrics = content["metrics"]
        self.reports.setdefault(round_, {})[cid] = {k: metrics[k] for k in ("state-in", "state-out") if k in metrics}
        if "error" in content:
            return self._reject(cid, round_, 0, f"ClientFailed: {site}: {content['error']['message']}")
        try:  # an upload's weight is the census's count, never the reply's claim (a phase that uploads nothing weighs nothing)
            samples = vouched_samples(site, self.roster.by_id[cid].samples, metrics, self.privacy is not None) if "upload" in content else 0
        except ClaimRefused as e:
            return self._reject(cid, round_, 0, f"UploadRejected: {e}")
        upload, sent = None, 0
        if "upload" in content:
            try:  # the method's declared upload (`Algorithm.upload_layout`; by default the download's layout)
                upload = check_upload(site, self.expected_upload(work, content["upload"].keys()), content["upload"])
                problem = self.algorithm.upload_problem(self.phase, work.download, upload) if self.algorithm else None
                if problem:
                    raise UploadRejected(f"upload from {site}: {problem}")
            except UploadRejected as e:
                return self._reject(cid, round_, samples, f"UploadRejected: {e}")
            audit.record(self.log_path, round_, "check_upload", upload.values(), client=cid)  # test-only, off unless set
            sent = record_bytes(content["upload"])
        stats = ClientStats(float(metrics.get("loss", 0.0)), int(metrics.get("samples", 0)))
        norm = float(metrics["update-norm"]) if "update-norm" in metrics else None  # privacy: the norm before clipping
        return ClientOutcome(cid, samples, upload, None, stats, sent, update_norm=norm)

    def expected_upload(self, work: ClientWork, sent: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """The layout `work`'s upload must have: the method's own declaration (`Algorithm.upload_layout`), in the form
        the names `sent` pick where the method uploads one of several (IFCA's cluster, FedMN's units)."""
        layout = work.download if self.algorithm is None else self.algorithm.upload_layout(self.phase, work.download, sent)
        if self.privacy is not None:  # a private upload is the clipped update, float64 (`Privacy.privatize`)
            layout = {k: t.to(torch.float64) for k, t in layout.items()}
        return layout

    def _reject(self, cid: int, round_: int, samples: int, error: str) -> ClientOutcome:
        log.warning("Round %d: %s; the round goes on without it.", round_, error)
        self.rejected.append({"round": round_, "client": cid, "error": error})
        return ClientOutcome(cid, samples, error=error)


def exchange(grid: Grid, messages: list[Message], timeout: float) -> dict[int, Message]:
    """{destination node: its reply} for the replies in within `timeout` (Grid.push_messages / pull_messages, as
    Grid.send_and_receive does). Replies are matched by the message they answer, not by their source: an error
    reply the SuperLink makes itself for an offline node (NODE_UNAVAILABLE) comes from the SuperLink's node id."""
    if not messages:
        return {}
    ids = list(grid.push_messages(messages))
    pending = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages) if mid}
    replies: dict[int, Message] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for r in grid.pull_messages(list(pending)):
            node = pending.pop(r.metadata.reply_to_message_id, None)
            if node is not None:
                replies[node] = r
        if pending:
            time.sleep(POLL)
    return replies


class RoundLog:
    """A RoundCallback writing, after each round, the server's checkpoint (its phase state, `fedpipe.federation.resume`),
    one JSON line (rounds.jsonl) and the global model."""

    def __init__(self, out: Path, algorithm: Algorithm, trainer: SiteRound, publish=lambda *names: None):
        self.out, self.algorithm, self.trainer, self.publish = out, algorithm, trainer, publish

    def on_phase_start(self, phase, state) -> None: ...

    def on_round_end(self, state: PhaseState, result: RoundResult) -> None:
        resume.save(self.out, state, self.trainer.spec_json)  # first: a line in rounds.jsonl means a checkpointed round
        line = {"phase": result.phase.name, "round": result.round, "clients": result.clients, "failed": result.failed_clients,
                "loss": result.loss_sum / max(result.samples, 1), "bytes_up": result.bytes_uploaded,
                "bytes_down": result.bytes_downloaded, "seconds": result.seconds,
                "rejected": [r for r in self.trainer.rejected if r["round"] == result.round],
                "reported": {str(c): m for c, m in sorted(self.trainer.reports.get(result.round, {}).items())}}
        if state.privacy is not None:  # the accountant's ledger after this round (the server's; the sites release nothing else)
            line["privacy"] = {"epsilon": result.extra.get("epsilon", state.privacy.epsilon()), "delta": state.privacy.delta,
                               "clip": result.extra.get("privacy_clip")}
        secure = getattr(self.trainer, "secure", {}).get(result.round)
        if secure is not None:  # SecAgg+: how many masked vectors were summed, and the bytes of its four stages
            line["secure_aggregation"] = secure
        with open(self.out / "rounds.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        save_global(self.out / "global.safetensors", state.server.global_params)
        self.publish(resume.CHECKPOINT, "rounds.jsonl", "global.safetensors")  # to the run's store, the checkpoint first

    def on_phase_end(self, phase, state) -> None: ...


def save_global(path: Path, params: dict[str, torch.Tensor]) -> None:
    tmp = path.with_suffix(".tmp")
    safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in params.items()}, str(tmp))
    tmp.replace(path)


def evaluate_at_sites(grid: Grid, roster: Roster, spec: FederationSpec, global_params: dict[str, torch.Tensor],
                      timeout: float, champion: dict[str, torch.Tensor] | None = None) -> dict[int, dict]:
    """Each site scores its own candidates on its own splits (`client_app.evaluate`), and, when given, the promoted
    version's global model on its share of the global test set; only the scores come back."""
    config = ConfigRecord({"spec": spec.to_json()})
    content = {"download": to_record(global_params), "config": config}
    if champion is not None:
        content["champion"] = to_record(champion)
    asks = [Message(RecordDict(content), dst_node_id=e.node_id, message_type=MessageType.EVALUATE) for e in roster.clients]
    by_node = {e.node_id: e for e in roster.clients}
    scores = {}
    for node, reply in exchange(grid, asks, timeout).items():
        entry = by_node[node]
        if reply.has_error():
            log.warning("Site %s did not evaluate: %s", entry.client_id, reply.error.reason)
            continue
        try:
            scores[entry.client_id] = vouched_scores(f"site {entry.client_id} (node {node})", entry.samples,
                                                     reply.content.metric_records.get("metrics") or {})
        except ClaimRefused as e:
            log.warning("Evaluation refused: %s; the site is left out of the evaluation and the gate", e)
    return scores


def read_champion(out: Path, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The promoted version's server state the run is gated against (None: no champion.safetensors), checked against
    this run's model before any round: the sites score it with this run's network, so names and shapes must match."""
    return _read_model(out / resume.CHAMPION, initial, "the promoted version's model", "the sites could not score it; "
                       "publish this run to another line (registry.name)")


def read_warm_start(out: Path, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The global model of the version train.init_from names (None: no warm-start.safetensors), checked like the
    champion: it replaces the seeded initialisation as the server's round-0 model."""
    warm = _read_model(out / resume.WARM_START, initial, "the warm start's model (train.init_from)",
                       "start from a version of this configuration, or set train.init_from=none")
    if warm is None:
        return None
    log.info("fedpipe federation: round 0's global model is the warm start's (%s), not the seed's", out / resume.WARM_START)
    return {k: warm[k].to(t.device) for k, t in initial.items()}


def read_warm_ledger(out: Path, spec: FederationSpec) -> Ledger | None:
    """With privacy, the accountant of the version the warm start is from (warm-start-ledger.json, written by the
    submitter from the version's state: `fedpipe.models.federated.warm_start_for`), which this run's accountant
    continues as a simulated private warm start does; None without one. Read bounded and checked field by field
    (`Ledger.from_json`): a forged history would understate epsilon."""
    path = out / resume.WARM_LEDGER
    if spec.privacy_cfg is None or not path.exists():
        return None
    if path.stat().st_size > LEDGER_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes, more than a privacy ledger ({LEDGER_BYTES}): submit the run again")
    try:
        ledger = Ledger.from_json(json.loads(path.read_text()))
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{path} is not a privacy ledger fedpipe wrote ({e}): submit the run again") from None
    log.info("fedpipe federation: the accountant continues the warm start's (%d private rounds, epsilon %.3f)", ledger.rounds,
             ledger.epsilon())
    return ledger


LEDGER_BYTES = 64 * 2**20


def _read_model(path: Path, initial: dict[str, torch.Tensor], what: str, fix: str) -> dict[str, torch.Tensor] | None:
    if not path.exists():
        return None
    params = safetensors.torch.load_file(str(path), device="cpu")
    differ = sorted(set(params) ^ set(initial)) or [k for k in params if (params[k].shape, params[k].dtype) != (initial[k].shape, initial[k].dtype)]
    if differ:
        raise ConfigError(f"{path}: {what} is not this run's network ({len(differ)} parameters differ, e.g. {differ[0]!r}): {fix}")
    return params


def stages(spec: FederationSpec) -> tuple[str, ...]:
    """What a submission may stop after (run config `stop-after`): the census, each phase, the evaluation (the whole
    run). The pipeline's federation tasks submit one each; `fedpipe run` submits the whole run."""
    return ("census", *(p.name for p in spec.phases()), "evaluate")


def serve(grid: Grid, spec: FederationSpec, out: Path, timeout: float, round_timeout: float | None = None,
          rejoin_wait: float = 0.0, stop_after: str = "evaluate", publish=lambda *names: None) -> PhaseState | None:
    """Every phase of the spec's method, against the sites connected to `grid`, then each site's own evaluation;
    with `stop_after` (one of `stages(spec)`) only up to that stage: the census alone, or the phases up to that one
    (from the checkpoint in `out`: a phase already done is not run again). `publish(*names)` copies outputs to the
    run's store as they are written (`fedpipe.federation.outputs`).

    The fault rule: a round waits for each chosen site's reply until `round_timeout` seconds (a site killed or hung
    mid-round counts as failed, `SiteTimeout`; Flower answers sooner, `SiteError`, once the SuperLink sees the node
    offline); a site not connected at a round's start is waited for up to `rejoin_wait` seconds, then left out
    (`SiteOffline`); the round is kept when at least min(train.min_clients, chosen) sites reported back, else the
    phase fails (`fedpipe.engine.rounds.run_round`)."""
    if stop_after not in stages(spec):
        raise ConfigError(f"stop-after {stop_after!r} is not a stage of {spec.method['name']}: choose from {', '.join(stages(spec))}")
    torch.set_num_threads(spec.threads)
    out.mkdir(parents=True, exist_ok=True)
    secure, audited = spec.federation_cfg.secure_aggregation.enabled, audit.enabled()
    if secure or audited:
        from fedpipe.federation import secagg  # Flower's legacy server stack, loaded only when needed

        if audited:  # test-only: every reply the server receives is audited
            grid = secagg.MeteredGrid(grid, out)
    # the census first: with the sites' own files, the data's shape (and so the model) is known only from it
    names = tuple(spec.federation_cfg.site_names)
    roster, spec, census = wait_for_sites(grid, spec.num_sites, timeout, spec, names)
    (out / "census.json").write_text(json.dumps(census.summary()))
    publish("census.json")
    algorithm, initial = spec.build(DEVICE)
    champion = read_champion(out, initial)  # before any round: a champion the sites cannot score fails the run now
    initial = read_warm_start(out, initial) or initial  # the sites' personal parts start anew either way
    if stop_after == "census":
        _finish(out, publish, {"stage": "census", "sites": roster.num_clients, "names": [s.name for s in census.sites]})
        return None
    if secure:
        for phase in spec.phases():
            secagg.check_secure(spec, algorithm, phase)
    if audited:  # test-only: and every aggregation hook the server has
        algorithm = audit.AuditedAlgorithm(algorithm, out)
    log.info("fedpipe federation: %d sites: %s", roster.num_clients, [(e.client_id, e.node_id) for e in roster.clients])
    state = resume.load(out, spec.to_json(), spec.method["name"]) or fresh_state(spec, roster, census, initial, out)
    if state.round:
        publish(resume.RESUMES)
        log.info("fedpipe federation: resuming after round %d (phase %s) from %s", state.round, state.phase, out / resume.CHECKPOINT)
    trainer = lambda phase: SiteRound(grid, roster, spec, phase, round_timeout or timeout, out, rejoin_wait, algorithm)  # noqa: E731
    state, stopped = _train(spec, algorithm, roster, state, trainer, out, stop_after, publish)
    if stopped:
        return state
    save_global(out / "global.safetensors", state.server.global_params)
    publish("global.safetensors")
    scores = evaluate_at_sites(grid, roster, spec, state.server.global_params, timeout, champion)
    (out / "evaluation.json").write_text(json.dumps({str(c): s for c, s in sorted(scores.items())}))
    publish("evaluation.json")
    _finish(out, publish, {"stage": "evaluate", "phase": state.phase, "round": state.round, "sites": roster.num_clients,
                           "server_client_states": len(state.clients) + len(state.server.per_client)})
    return state


def fresh_state(spec: FederationSpec, roster: Roster, census: Census, initial: dict[str, torch.Tensor], out: Path) -> PhaseState:
    """The run's state before its first round: with privacy, the warm start's ledger continued (`read_warm_ledger`), and
    the census's noised label counts (`census_release`) spent in it once, at sample rate 1 (a resumed run's checkpoint
    holds that spend already; a census retaken by a later submission releases the same numbers again)."""
    state = PhaseState(spec.method["name"], "init", 0, ServerState(initial), {}, privacy=read_warm_ledger(out, spec))
    z = census_release(spec)
    if z is not None and census.noised:
        cfg = spec.privacy_cfg
        if state.privacy is None:  # the ledger `fedpipe.engine.rounds.ledger_of` would open at the first round
            state.privacy = Ledger(cfg.accountant, cfg.delta if cfg.delta is not None else default_delta(roster.num_clients))
        state.privacy.spend(z, 1.0)
        log.info("fedpipe federation: the census's noised label counts (noise multiplier %g) spend epsilon %.3f", z,
                 state.privacy.epsilon())
    return state


def _train(spec: FederationSpec, algorithm: Algorithm, roster: Roster, state: PhaseState, trainer, out: Path, stop_after: str,
           publish) -> tuple[PhaseState, bool]:
    """The phases' rounds from `state` on (`trainer(phase)`: the phase's SiteRound; SecAgg+ wraps it), each round logged
    and published; (state, True) when `stop_after` names a phase, which then ends the submission."""
    for phase in spec.phases():
        site_round = trainer(phase)
        if spec.federation_cfg.secure_aggregation.enabled and phase.communicates:  # a finetune phase sends nothing to sum
            from fedpipe.federation import secagg

            site_round = secagg.SecureSiteRound(site_round, spec)
        eligible = sum(1 for e in roster.clients if not (phase.communicates and e.opt_out))
        privacy = server_privacy(spec, phase, eligible, out)  # None without privacy (fedpipe.federation.private)
        site_round.privacy = privacy
        state = run_phase(algorithm, phase, roster, state, spec.train_cfg, spec.seed, site_round,
                          [RoundLog(out, algorithm, site_round, publish)], privacy)
        if phase.name == stop_after:
            resume.save(out, state, spec.to_json())  # the phase's end, also when its rounds were all done before
            save_global(out / "global.safetensors", state.server.global_params)
            publish(resume.CHECKPOINT, "global.safetensors")
            _finish(out, publish, {"stage": phase.name, "phase": state.phase, "round": state.round, "sites": roster.num_clients})
            return state, True
    return state, False


def _finish(out: Path, publish, result: dict) -> None:
    """result.json, what the submitter waits for: written last."""
    (out / "result.json").write_text(json.dumps(result))
    publish("result.json")


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The run config: `store` and `prefix` (the run's store and `<run>/federation`, where the submitter put spec.json
    and waits for result.json: `fedpipe.federation.outputs`), or `out-dir` and `spec-file` (a folder on this machine:
    the try-out); `stop-after` (a stage, `stages`; default the whole run); the timeouts. The places are the submitter's
    word, so each is checked against the ones this SuperLink's deployment fixes (`fedpipe.federation.places`) before
    anything is read, written or deleted; a refused run writes nothing, not even error.json (the refusal is in the
    SuperLink's log)."""
    rc = context.run_config
    try:
        if str(rc.get("store", "")):
            outputs = ServerOutputs(*places.store_place(str(rc["store"]), str(rc.get("prefix", ""))))
            out, spec_file = outputs.folder, outputs.folder / "spec.json"
        else:
            outputs = None
            out = places.local_place(str(rc.get("out-dir", "")), "out-dir")
            spec_file = places.local_place(str(rc.get("spec-file", "")), "spec-file")
    except places.PlaceRefused as e:
        log.error("fedpipe federation: run refused: %s", e)
        raise
    publish = outputs.push if outputs is not None else (lambda *names: None)
    for stale in ("result.json", "error.json"):  # a restarted run's submitter waits on these: none from a killed one
        (out / stale).unlink(missing_ok=True)
    try:
        if outputs is not None:
            outputs.pull()
        spec = FederationSpec.read(spec_file)
        serve(grid, spec, out, float(rc.get("timeout", 300)), float(rc.get("round-timeout", 0)) or None,
              float(rc.get("rejoin-wait", 0)), str(rc.get("stop-after", "")) or "evaluate", publish)
    except BaseException as e:  # the submitter waits on result.json or error.json
        out.mkdir(parents=True, exist_ok=True)
        (out / "error.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        try:
            publish("error.json")
        except Exception as failed:  # the store itself may be what failed: the SuperLink's log keeps the error
            log.error("fedpipe federation: could not write error.json to the run's store: %s", failed)
        raise
