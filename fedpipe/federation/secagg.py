"""Secure aggregation (SecAgg+, Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead",
CCS 2020) of a round's uploads: the server side, with Flower 1.42's own protocol code.

Design. `fedpipe.engine.rounds.run_phase` still chooses the clients, makes their downloads (`algorithm.download`),
schedules the learning rate and applies the aggregate; only the `RoundTrainer` differs from `server_app.SiteRound`:
`SecureSiteRound` runs one `SecAggPlusWorkflow` per round
(flwr/server/workflow/secure_aggregation/secaggplus_workflow.py: setup, share keys, collect masked vectors, unmask),
and returns `(outcomes, averaged)`: outcomes without uploads (what each site reported: samples, loss, bytes) and
the weighted mean the workflow unmasked. `run_round` then applies that mean with `algorithm.apply_average`, the
path a distributed phase's all-reduced mean takes, which `Algorithm.aggregate` itself ends in for a
`WEIGHTED_MEAN` method (fedpipe/algorithms/aggregation.py): no second copy of FedAvg's math, and no
pseudo-upload. The workflow computes sum_k w_k theta_k / sum_k w_k itself (unmask_stage: `factor_extract` takes
the summed weights out of the summed masked vector), with w_k the site's sample count quantised at the site.

The workflow is bound to the legacy Strategy API: `__call__` raises TypeError unless its context is a
`flwr.server.compat.legacy_context.LegacyContext`; it samples through `strategy.configure_fit` and hands the
unmasked mean to `strategy.aggregate_fit` (every result's parameters replaced by it). `RoundStrategy` is that
shim: `configure_fit` returns the FitIns of the clients `run_phase` chose (their downloads), and `aggregate_fit`
keeps the mean and what each site reported. The server never holds one site's update: the replies of the collect
stage carry masked integer vectors (their array records are cleared by the site's `secaggplus_mod`).

`MeteredGrid` wraps the Grid for the workflow: it counts the bytes of every message of the four stages (each
message's serialised objects, flwr/supercore/inflatable/inflatable_object.py `get_all_nested_objects`, as the
SuperLink stores and forwards them), remembers why a site's reply was an error, and feeds the test-only audit
(fedpipe/federation/audit.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, bytes_to_ndarray, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute

from fedpipe.algorithms.base import Algorithm, Phase
from fedpipe.config import SecureAggregationConfig
from fedpipe.engine.clients import ClientOutcome, ClientWork
from fedpipe.engine.sequential import ClientStats
from fedpipe.errors import ConfigError
from fedpipe.federation import audit
from fedpipe.federation.private import masked_layout
from fedpipe.federation.spec import FederationSpec, refusal
from fedpipe.federation.transport import POLL

log = logging.getLogger(__name__)
STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")


def workflow_of(cfg: SecureAggregationConfig, timeout: float) -> SecAggPlusWorkflow:
    """Flower's workflow for the config (its own checks: num_shares > 2 as an int, threshold < num_shares, ...)."""
    return SecAggPlusWorkflow(cfg.num_shares, cfg.reconstruction_threshold, max_weight=float(cfg.max_weight),
                              clipping_range=float(cfg.clipping_range), quantization_range=int(cfg.quantization_range),
                              timeout=timeout)


def check_secure(spec: FederationSpec, algorithm: Algorithm, phase: Phase) -> None:
    """ConfigError unless the spec's method may run under SecAgg+ (a spec file is not necessarily from
    `FederationSpec.from_run_config`, which refuses it already), `phase` aggregates by the plain weighted mean, and no
    robust rule is asked for (train.robust: SecAgg+ hands the server only the sum)."""
    # a robust rule (train.robust) needs each update, which SecAgg+ never shows the server: `refusal` says so
    why = refusal(spec.method["name"], secure_aggregation=True, robust=spec.train_cfg.robust.active)
    if why:
        raise ConfigError(why)
    if phase.communicates and algorithm.secure_weighting(phase) is None:
        raise ConfigError(f"federation.secure_aggregation: phase {phase.name!r} of {spec.method['name']!r} does not aggregate by "
                          f"a mean of the uploads ({algorithm.aggregation(phase).description}): the server would need each upload")


def message_bytes(msg: Message) -> int:
    """Bytes of a message's serialised objects (metadata, records, arrays), as Flower 1.42 pushes and pulls them."""
    try:
        return sum(len(o.deflate()) for o in get_all_nested_objects(msg).values())
    except Exception:  # an error reply without content deflates too; anything odd counts as 0, never fails a round
        return 0


def _stage_of(msg: Message) -> str:
    cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS) if msg.has_content() else None
    return str(cfg[Key.STAGE]) if cfg is not None and Key.STAGE in cfg else "?"


class MeteredGrid:
    """The Grid the workflow talks through: the same pushes and pulls, with bytes per stage and node, each node's
    last error, and (test-only) the audit of every array that reaches the server. Replies are pulled every POLL seconds
    (Flower's own send_and_receive, flwr/superlink/grid/http_grid.py, sleeps 3 s between pulls)."""

    def __init__(self, grid: Grid, out: Path):
        self.grid, self.out = grid, out
        self.round = 0
        self.stage = ""
        self.down: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # stage -> node -> bytes
        self.up: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.errors: dict[int, str] = {}
        self.replied: dict[str, set[int]] = defaultdict(set)
        self.seconds: dict[str, float] = defaultdict(float)  # stage -> seconds from its first push to its last reply

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        messages, t0 = list(messages), time.monotonic()
        dst: dict[str, int] = {}
        for m in messages:
            self.stage = _stage_of(m)
        for mid, m in zip(self.grid.push_messages(messages), messages):
            if mid:
                dst[mid] = m.metadata.dst_node_id
        with no_object_id_recompute():  # counted after the push, which computed every object's id: each is deflated once here
            for m in messages:
                self.down[self.stage][m.metadata.dst_node_id] += message_bytes(m)
        replies: list[Message] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while dst and (deadline is None or time.monotonic() < deadline):
            for r in self.grid.pull_messages(list(dst)):
                node = dst.pop(r.metadata.reply_to_message_id, None)
                if node is None:
                    continue
                self.up[self.stage][node] += message_bytes(r)
                if r.has_error():
                    self.errors[node] = f"{self.stage}: {r.error.reason}"
                else:
                    self.replied[self.stage].add(node)
                    self.audit(r)
                replies.append(r)
            if dst:
                time.sleep(POLL)
        for node in dst.values():
            self.errors.setdefault(node, f"{self.stage}: no reply within {timeout:.0f}s")
        self.seconds[self.stage] += time.monotonic() - t0
        return replies

    def push_messages(self, messages):  # the plain path's exchange, when the audit wraps it
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(self.grid.pull_messages(message_ids))
        for r in replies:
            if not r.has_error():
                self.audit(r)
        return replies

    def audit(self, reply: Message) -> None:
        """Test-only (audit.enabled): the digest of every array record and masked vector in a reply."""
        if not audit.enabled():
            return
        node = reply.metadata.src_node_id
        for key, record in reply.content.array_records.items():
            audit.record(self.out, self.round, f"reply:{key}", [a.numpy() for a in record.values() if a.data], node=node)
        cfg = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if cfg is not None and Key.MASKED_PARAMETERS in cfg:
            audit.record(self.out, self.round, "reply:masked-vector", [bytes_to_ndarray(b) for b in cfg[Key.MASKED_PARAMETERS]], node=node)

    def start_round(self, round_: int) -> None:
        self.round, self.stage = round_, ""
        self.down.clear(), self.up.clear(), self.errors.clear(), self.replied.clear(), self.seconds.clear()


class RoundStrategy(Strategy):
    """The legacy Strategy SecAggPlusWorkflow drives (flwr/server/strategy/strategy.py): it samples nobody itself
    (`run_phase` chose the round's clients) and aggregates nothing itself (the workflow unmasked the mean)."""

    def __init__(self, out: Path):
        self.out = out
        self.fitins: list = []
        self.mean: list[np.ndarray] | None = None
        self.reports: dict[int, tuple[int, dict]] = {}  # node -> (num_examples, metrics)

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        return self.fitins

    def aggregate_fit(self, server_round, results, failures):
        # every result's parameters are the unmasked mean (secaggplus_workflow.py, unmask_stage): one array list
        for proxy, fitres in results:
            self.reports[proxy.node_id] = (int(fitres.num_examples), dict(fitres.metrics))
            audit.record(self.out, server_round, "aggregate_fit", parameters_to_ndarrays(fitres.parameters), node=proxy.node_id)
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}  # nothing for the workflow to store: run_round applies the mean

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class SecureSiteRound:
    """A `RoundTrainer` (fedpipe.engine.rounds) whose chosen sites' uploads are summed under SecAgg+ masks; the
    server gets their weighted mean and what each site reported (samples, loss, state digests), never an upload.

    It wraps the plain round's `server_app.SiteRound` (built for the same grid, roster, phase and timeouts) and
    takes from it what does not change: the wait for sites that rejoin (`online`), the log of refused sites
    (`_reject`, `rejected`) and what sites report (`reports`); server_app wraps it, so there is no import cycle."""

    def __init__(self, plain, spec: FederationSpec):
        self.plain = plain
        grid = plain.grid
        self.metered = plain.grid = grid if isinstance(grid, MeteredGrid) else MeteredGrid(grid, plain.log_path)
        self.cfg = spec.federation_cfg.secure_aggregation
        self.workflow = workflow_of(self.cfg, plain.timeout)
        self.secure: dict[int, dict] = {}  # round -> what rounds.jsonl records of its protocol

    def __getattr__(self, name):  # roster, phase, spec_json, log_path, rejoin_wait, online, _reject, rejected, reports
        return getattr(self.plain, name)

    @property
    def privacy(self):
        """The phase's Privacy at the server (set by serve), shared with the plain round, whose upload layout it changes."""
        return self.plain.privacy

    @privacy.setter
    def privacy(self, value) -> None:
        self.plain.privacy = value

    def __call__(self, round_: int, lr: float, works: list[ClientWork]) -> tuple[list[ClientOutcome], dict | None]:
        grid = self.metered
        grid.start_round(round_)
        by_node = {self.roster.by_id[w.client_id].node_id: w for w in works}
        up = self.online(set(by_node))
        layout = works[0].download if works else {}
        names = list(layout)
        # what the sites sum: the method's upload layout (pFedMB: its branches and alpha; with privacy the clipped update,
        # float64, and with adaptive clipping each site's centred clip bit), in this order
        uploaded = self.uploaded(works[0]) if works else {}
        config = {"spec": self.spec_json, "phase": self.phase.name, "round": round_, "lr": float(lr), "names": json.dumps(names),
                  "upload-names": json.dumps(list(uploaded)),
                  **({"privacy-clip": float(self.privacy.clip)} if self.privacy is not None else {})}
        strategy = RoundStrategy(self.log_path)
        # the legacy wire layout (FitIns: parameters as NumPy arrays in `names` order, config scalars) is what the
        # workflow forwards in its collect stage (compat.fitins_to_recorddict) and the site's handler reads back
        strategy.fitins = [(GridClientProxy(node, grid, 0), FitIns(ndarrays_to_parameters([t.detach().cpu().numpy() for t in w.download.values()]), config))
                           for node, w in sorted(by_node.items()) if node in up]
        context = LegacyContext(Context(0, 0, {}, RecordDict(), {}), strategy=strategy)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: round_})
        # read by setup_stage and passed to configure_fit, which ignores it: each FitIns holds its client's download
        context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(ndarrays_to_parameters([]), True)
        t0 = time.perf_counter()
        if len(strategy.fitins) >= 2:
            self.workflow(grid, context)  # four exchanges; returns early (logged "halted") when too few sites remain
        halted = strategy.mean is None
        averaged = None if halted else self._averaged(strategy.mean, uploaded)
        if averaged is not None and self.privacy is not None:  # every site weighed max_weight: the mean times their number is the sum
            averaged = {k: v * len(strategy.reports) for k, v in averaged.items()}
        outcomes = [self._secure_outcome(w, node, round_, up, strategy, halted) for node, w in by_node.items()]
        self.secure[round_] = self._protocol_line(strategy, halted, len(strategy.fitins), time.perf_counter() - t0)
        if averaged is not None:
            audit.record(self.log_path, round_, "secure-aggregate", averaged.values())
            audit.keep(self.log_path, f"aggregate-{round_}", averaged)
        return outcomes, averaged

    def uploaded(self, work: ClientWork) -> dict[str, torch.Tensor]:
        """The layout the sites put under the masks: the method's upload (`SiteRound.expected_upload`), and with privacy's
        adaptive clipping the centred clip bit (`CLIP_BIT`), summed with the updates so that no bit is seen alone."""
        layout = self.plain.expected_upload(work)
        return layout if self.privacy is None else masked_layout(layout, self.privacy.cfg)

    @staticmethod
    def _averaged(mean: list[np.ndarray], layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unmasked mean (float64 from Flower's dequantisation) in the download's names, shapes and dtypes."""
        if len(mean) != len(layout):
            raise ValueError(f"SecAgg+ returned {len(mean)} arrays for a {len(layout)}-tensor upload layout")
        out = {}
        for (name, t), a in zip(layout.items(), mean):
            if a.size != t.numel():
                raise ValueError(f"SecAgg+ mean of {name}: {a.size} values, expected {t.numel()}")
            out[name] = torch.from_numpy(np.asarray(a)).reshape(t.shape).to(t.dtype)
        return out

    def _secure_outcome(self, w: ClientWork, node: int, round_: int, up: set[int], strategy: RoundStrategy, halted: bool) -> ClientOutcome:
        cid, site = w.client_id, f"site {w.client_id} (node {node})"
        if node not in up:
            return self._reject(cid, round_, 0, f"SiteOffline: {site} was not connected at the round's start "
                                                f"(waited {self.rejoin_wait:.0f}s for it to rejoin)")
        if len(strategy.fitins) < 2:
            return self._reject(cid, round_, 0, f"SecAggHalted: only {len(strategy.fitins)} site(s) online; SecAgg+ needs at least 2")
        grid = self.metered
        if node in strategy.reports and not halted:
            num_examples, metrics = strategy.reports[node]
            self.reports.setdefault(round_, {})[cid] = {k: metrics[k] for k in ("state-in", "state-out") if k in metrics}
            sent = sum(grid.up[s].get(node, 0) for s in STAGES)
            return ClientOutcome(cid, int(metrics.get("num-samples", num_examples)), None, None,
                                 ClientStats(float(metrics["loss"]), int(metrics["samples"])), sent)
        why = grid.errors.get(node, "its masked vector was not summed")
        if halted:
            return self._reject(cid, round_, 0, f"SecAggHalted: the SecAgg+ round stopped in stage {grid.stage or '?'} "
                                                f"({self._halt_reason()}); {site}: {why}")
        return self._reject(cid, round_, 0, f"SecAggDropped: {site} left the SecAgg+ round ({why}); the others' sum was "
                                            "unmasked without it")

    def _halt_reason(self) -> str:
        w = self.workflow
        return (f"fewer active sites than reconstruction_threshold={w.reconstruction_threshold} among some site's "
                f"num_shares={w.num_shares} neighbours, or no masked vector left")

    def _protocol_line(self, strategy: RoundStrategy, halted: bool, sampled: int, seconds: float) -> dict:
        grid = self.metered
        stages = {s: {"down": sum(grid.down[s].values()), "up": sum(grid.up[s].values()), "seconds": round(grid.seconds[s], 3)}
                  for s in STAGES if s in grid.down}
        return {"protocol": "secagg+", "sites_sampled": sampled, "sites_summed": 0 if halted else len(strategy.reports),
                "halted": halted, "bytes_down": sum(v["down"] for v in stages.values()),
                "bytes_up": sum(v["up"] for v in stages.values()), "stages": stages, "seconds": seconds,
                "num_shares": self.workflow.num_shares, "reconstruction_threshold": self.workflow.reconstruction_threshold}
