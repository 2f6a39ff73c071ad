"""fedpipe's ClientApp: a site's side of a federated round, run by the site's SuperNode.

Flower 1.42 API used (flwr/clientapp/client_app.py): `ClientApp()` with `@app.train()` and `@app.query()`
handlers `(msg: Message, context: Context) -> Message`; the reply is `Message(content, reply_to=msg)`
(flwr/app/message/message.py). The site's folder comes from the SuperNode's node config
(`flower-supernode --node-config 'site-dir="..."'`, read as `context.node_config["site-dir"]`).

The site trains with `fedpipe.engine.clients.ClientTrainer`, the code the simulation trains every client
with; the algorithm object is built from the spec the server sends (`FederationSpec`), so there is no
second copy of any update rule. It returns only what the method's `client_result` uploads; the
personal state it returns is saved in the site's own folder (`Site.save_state`) and never sent.

Secure aggregation (`federation.secure_aggregation`, server side fedpipe/federation/secagg.py): a TRAIN message
that carries SecAgg+ configs goes through Flower's `secaggplus_mod` (flwr/client/mod/secure_aggregation/
secaggplus_mod.py; Bell et al. 2020), which answers the setup, share-keys and unmask stages itself and, in the
collect-masked-vectors stage, calls `secure_train` and masks its upload. The site checks its own upload first
(`check_own_upload`): the server sees only masked integers and can no longer check values.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from fedpipe.algorithms.base import Algorithm, ServerState
from fedpipe.engine.clients import ClientOutcome, ClientTrainer, ClientWork
from fedpipe.engine.evaluation import evaluate_model, evaluate_personalized
from fedpipe.engine.privacy import CLIP_BIT, centred_bit
from fedpipe.federation import audit
from fedpipe.federation.faults import claimed_samples, corrupt, inflated_evaluation, injected_fault
from fedpipe.federation.private import census_release, masked_layout, noised_counts, secret_in, site_privacy
from fedpipe.federation.sites import Site, keep_for_serving, state_digest
from fedpipe.federation.spec import FederationSpec
from fedpipe.federation.transport import UploadRejected, check_upload, from_record, to_record

log = logging.getLogger(__name__)
app = ClientApp()
DEVICE = torch.device("cpu")



class OptedOut(RuntimeError):
    """A communicating phase's round asked of a site that opts out."""


@dataclass
class SiteSettings:
    """What the site's own policy sets here (`fedpipe.federation.worker` sets it from the policy before each message;
    a ClientApp run by Flower's own `flwr-clientapp` keeps these defaults): torch threads at most, whether the census
    may release the label counts, the most megabytes of prepared splits kept, and whether the site opts out (as the
    node config's `opt-out` can also say)."""

    max_threads: int = os.cpu_count() or 1
    label_counts: bool = True
    max_cache_mb: int = 4096
    opt_out: bool = False


SETTINGS = SiteSettings()
#: the warm worker's site of the run it is serving: its prepared splits stay loaded between the run's messages
_WARM: dict[tuple, Site] = {}


def opts_out(site: Site) -> bool:
    """Whether this site takes part in no communicating phase (uploads nothing): its node config or its policy says so."""
    return site.opt_out or SETTINGS.opt_out


def use_threads(spec: FederationSpec) -> None:
    torch.set_num_threads(max(1, min(int(spec.threads or 1), SETTINGS.max_threads)))


def _site(context: Context, spec: FederationSpec | None = None, client_id: int | None = None) -> Site:
    """This site, from its node config: an exported try-out folder, or its own files split with the spec's data
    parameters and numbered as the server's census assigned (`Site.assigned`). Kept for the run's next message."""
    if client_id is None and spec is not None and spec.site_data:
        client_id = Site.assigned(context.node_config["site-dir"], spec)
    key = (context.run_id, json.dumps(dict(context.node_config), sort_keys=True, default=str),
           spec.to_json() if spec is not None else "", client_id)
    if key not in _WARM:
        _WARM.clear()  # one run's site at a time: a new run (or a new numbering) reads its data afresh
        _WARM[key] = Site.from_node(context.node_config, DEVICE, spec, client_id, max_cache_mb=SETTINGS.max_cache_mb)
    return _WARM[key]


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """The census (`fedpipe.federation.census`): which client this site is, or, for a site with its own files, its
    name, labels, input shape and label counts (it splits its files here, with the spec the query carries). Then the
    server's numbering of the sites ("assign"), kept in the site's folder for the run's later messages."""
    ask = msg.content["ask"]
    spec = FederationSpec.from_json(str(ask["spec"])) if "spec" in ask else None
    if str(ask.get("what", "identity")) == "assign":
        Site.assign(context.node_config["site-dir"], spec, int(ask["client-id"]))
        return Message(RecordDict({"site": ConfigRecord({"assigned": int(ask["client-id"])})}), reply_to=msg)
    site = _site(context, spec, client_id=-1 if spec is not None and spec.site_data else None)
    (client,) = site.data.clients
    # the counts the server weighs this site's uploads and scores by for the whole run (`census.Samples`)
    samples = {"train": len(client.train), "test": len(client.test), "holdout": len(site.data.global_test) if site.census is not None else 0}
    answer = {"client-id": site.client_id, "opt-out": opts_out(site), "samples": json.dumps(samples)}
    if site.census is not None:
        # what the server needs and nothing more: the snapshot's digest, not the site's local path or file counts
        digest = site.census["snapshot"]["digest"]
        census = {**site.census, "snapshot": {"digest": digest}}
        private = spec is not None and spec.privacy_cfg is not None
        if not SETTINGS.label_counts or (private and census_release(spec) is None):
            census["counts"] = None  # the site's policy, or privacy without a census release: not released at all
        elif private and census["counts"] is not None:  # the Gaussian mechanism on the histogram, noised with the site's own secret
            cfg = spec.privacy_cfg
            census["counts"] = noised_counts(cfg, spec.seed, None if cfg.seeded_noise else secret_in(site.folder), digest, census["counts"])
            census["counts_noise"] = float(cfg.census_noise_multiplier)
        answer["census"] = json.dumps(census)
    return Message(RecordDict({"site": ConfigRecord(answer)}), reply_to=msg)


def _train_here(context: Context, spec: FederationSpec, phase_name: str, round_: int, lr: float,
                download: dict[str, torch.Tensor], clip: float | None = None) -> tuple[Site, ClientOutcome, dict | None, str | None, Algorithm]:
    """This site's round with `ClientTrainer` (the simulation's client code): (site, outcome, state it started
    from, the test-only injected fault)."""
    use_threads(spec)
    phase = spec.phase(phase_name)
    site = _site(context, spec)
    if phase.communicates and opts_out(site):  # the site's own rule, whatever the server asks
        raise OptedOut(f"site {site.client_id} opts out: it takes part in no communicating phase ({phase.name!r}) and uploads nothing")
    algorithm, initial = spec.build(DEVICE)
    if not phase.downloads:  # nothing was sent (Local): a client without a state starts from the run's seeded model
        download = initial
    # with privacy: clipped with the server's clip (and in local mode noised with this site's own secret) here
    privacy = site_privacy(spec, phase, clip, site.folder)
    trainer = ClientTrainer(algorithm, phase, site.data, spec.train_cfg, spec.engine_cfg, spec.seed, privacy=privacy)
    names = [p.name for p in spec.phases()]
    state = site.load_state(phase.name, DEVICE, tuple(names[:names.index(phase.name)]), spec)
    fault = injected_fault(round_)
    if fault == "hang":
        print(f"fault injector: site {site.client_id} hangs in round {round_}", file=sys.stderr, flush=True)
        time.sleep(3600)
    (outcome,) = trainer.train([ClientWork(site.client_id, download, state)], round_, lr)
    return site, outcome, state, fault, algorithm


@app.train()
def train(msg: Message, context: Context) -> Message:
    if RECORD_KEY_CONFIGS in msg.content.config_records:  # a SecAgg+ stage (secagg.SecureSiteRound)
        return secaggplus_mod(msg, context, secure_train)
    cfg = msg.content["config"]
    spec = FederationSpec.from_json(str(cfg["spec"]))
    phase = spec.phase(str(cfg["phase"]))
    round_, lr = int(cfg["round"]), float(cfg["lr"])
    download = from_record(msg.content["download"], DEVICE)
    clip = float(cfg["privacy-clip"]) if "privacy-clip" in cfg else None
    site, outcome, state, fault, _ = _train_here(context, spec, phase.name, round_, lr, download, clip)
    reply: dict = {}
    # state-in: a digest of the personal state this round started from (0: none), so a test can tell a site
    # that rejoined with its state from one that started afresh; the state itself never leaves the site
    metrics = {"num-samples": claimed_samples(round_, outcome.num_samples), "state-in": state_digest(state)}
    if outcome.error:
        reply["error"] = ConfigRecord({"message": outcome.error})
    else:
        site.save_state(phase.name, outcome.new_state, spec)  # stays here
        if outcome.upload is not None:
            upload = corrupt(outcome.upload, fault) if fault else outcome.upload
            reply["upload"] = to_record(upload)
            audit.record(site.folder, round_, "plain-upload", upload.values(), client=site.client_id)  # test-only, off unless set
        metrics.update({"loss": float(outcome.stats.loss), "samples": int(outcome.stats.samples),
                        "state-out": state_digest(outcome.new_state)})
        if outcome.update_norm is not None:  # privacy: the norm before clipping, which the server's adaptive clip counts
            metrics["update-norm"] = float(outcome.update_norm)
    privacy = spec.privacy_cfg
    if privacy is not None and privacy.mode == "local" and phase.communicates:
        # local DP: the server is not trusted with anything but the noised update (its loss, sample count, norm and state
        # digests would be releases no accountant counts); the server aggregates the noised updates unweighted (DP-FedAvg)
        metrics = {"private": 1}
    reply["metrics"] = MetricRecord(metrics)
    return Message(RecordDict(reply), reply_to=msg)


def check_own_upload(site: str, download: dict[str, torch.Tensor], upload: dict[str, torch.Tensor], weight: float,
                     cfg) -> None:
    """The site's own check of its upload before SecAgg+ masks it (the server, seeing masked integers, cannot):
    the server's `check_upload` (names, shapes and dtypes of the download, finite values, bytes), and no value that
    the mod's clipping would change: secaggplus_mod scales the upload by weight / max_weight and clips it to
    +-clipping_range before quantising (flwr/common/secure_aggregation/quantization.py), which would silently bias
    the sum. Raises UploadRejected."""
    check_upload(site, download, to_record(upload))
    scale = weight / cfg.max_weight
    worst = max((float(t.abs().max()) for t in upload.values() if t.numel()), default=0.0) * scale
    if worst > cfg.clipping_range:
        raise UploadRejected(f"upload from {site}: a value times its weight ({scale:.3g}) is {worst:.3g}, beyond "
                             f"secure_aggregation.clipping_range={cfg.clipping_range:g}: SecAgg+ would clip it")


def private_upload(spec: FederationSpec, layout: dict[str, torch.Tensor], outcome: ClientOutcome,
                   clip: float | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(layout, upload) a site puts under SecAgg+'s masks: without privacy the method's upload; with privacy the clipped
    (in local mode noised) update, float64, as the plain path uploads it, and with adaptive clipping the site's centred
    clip bit beside it (`CLIP_BIT`: summed with the others' under the masks, the server sees only the count)."""
    cfg = spec.privacy_cfg
    if cfg is None:
        return layout, outcome.upload
    bit = {CLIP_BIT: torch.tensor([centred_bit(float(outcome.update_norm), float(clip))], dtype=torch.float64)}
    return masked_layout(layout, cfg), {**outcome.upload, **(bit if cfg.adaptive_clip else {})}


def secure_train(msg: Message, context: Context) -> Message:
    """The collect-masked-vectors stage's training, called by `secaggplus_mod`: the download comes as the legacy
    FitIns (flwr/compat/common/recorddict_compat.py, parameters in the order of `config["names"]`) and the reply
    must be a legacy FitRes: the mod reads it with `recorddict_to_fitres`, weighs the parameters by num_examples,
    masks them and clears the reply's array records before it leaves.

    A site whose training fails or whose upload fails `check_own_upload` raises: Flower turns that into an error
    reply (flwr/supernode/runtime/run_clientapp.py), and the workflow counts the site as dropped after the share-keys
    stage; its pairwise masks are removed from the others' sum with the key shares its neighbours hold (SecAgg+'s
    dropout recovery), so the round's mean is the other sites' as long as every site keeps
    reconstruction_threshold live neighbours (else the round halts and fails: `fedpipe.federation.secagg`)."""
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    cfg = fitins.config
    spec = FederationSpec.from_json(str(cfg["spec"]))
    names = json.loads(str(cfg["names"]))
    arrays = parameters_to_ndarrays(fitins.parameters)
    if len(arrays) != len(names):
        raise UploadRejected(f"download of {len(arrays)} arrays for {len(names)} names")
    download = {n: torch.from_numpy(np.array(a, copy=True)).to(DEVICE) for n, a in zip(names, arrays)}
    round_ = int(cfg["round"])
    clip = float(cfg["privacy-clip"]) if "privacy-clip" in cfg else None  # privacy: the site clips with the server's clip
    site, outcome, state, fault, algorithm = _train_here(context, spec, str(cfg["phase"]), round_, float(cfg["lr"]), download, clip)
    who = f"site {site.client_id}"
    if outcome.error:
        raise RuntimeError(f"ClientFailed: {who}: {outcome.error}")
    if outcome.upload is None:
        raise UploadRejected(f"{who} uploads nothing in phase {cfg['phase']!r}: nothing to sum securely")
    secure = spec.federation_cfg.secure_aggregation
    phase = spec.phase(str(cfg["phase"]))
    layout, upload = private_upload(spec, algorithm.upload_layout(phase, download), outcome, clip)  # what the server sums
    order = json.loads(str(cfg["upload-names"]))
    if order != list(layout):
        raise UploadRejected(f"{who}: the server names the upload's tensors {order[:3]}..., the method {list(layout)[:3]}...")
    if algorithm.secure_weighting(phase) == "uniform" or spec.privacy_cfg is not None:
        # every site the same weight (pFedMe's uniform mean; with privacy every client counts once): the largest, the
        # finest quantisation
        weight = int(secure.max_weight)
    else:
        weight = min(outcome.num_samples, int(secure.max_weight))  # a site with more samples counts as max_weight
    upload = corrupt(upload, fault) if fault else upload
    upload = {n: upload[n] for n in order if n in upload} | {n: t for n, t in upload.items() if n not in order}
    check_own_upload(who, layout, upload, weight, secure)
    upload = algorithm.secure_upload(phase, upload)  # pFedMB: alpha * branch, so that the masked mean gives Eq. 5
    site.save_state(str(cfg["phase"]), outcome.new_state, spec)  # stays here
    audit.record(site.folder, round_, "plain-upload", upload.values(), client=site.client_id, weight=weight)  # test-only
    audit.keep(site.folder, f"upload-{round_}", upload)
    metrics = {"num-samples": outcome.num_samples, "state-in": state_digest(state), "loss": float(outcome.stats.loss),
               "samples": int(outcome.stats.samples), "state-out": state_digest(outcome.new_state)}
    if spec.privacy_cfg is not None and spec.privacy_cfg.mode == "local":  # as the plain path: nothing but the noised update
        metrics = {"num-samples": 0, "loss": 0.0, "samples": 0}
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([t.detach().cpu().numpy() for t in upload.values()]), weight, metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The site's own evaluation: the method's personalized candidates (SuPerFed: the lam grid between the global
    model it downloads and the local model in its store), chosen on its validation split, scored on its test
    split, by `fedpipe.engine.evaluation.evaluate_personalized`, the simulation's evaluation. Only scores leave."""
    cfg = msg.content["config"]
    spec = FederationSpec.from_json(str(cfg["spec"]))
    use_threads(spec)
    site = _site(context, spec)
    algorithm, _ = spec.build(DEVICE)
    server = ServerState(from_record(msg.content["download"], DEVICE))
    names = [p.name for p in spec.phases()]
    state = site.load_state(names[-1], DEVICE, tuple(names[:-1]), spec)
    states = {site.client_id: state} if state is not None else {}
    result = evaluate_personalized(algorithm, server, states, site.data, int(cfg.get("batch-size", 256)), 10)
    (c,) = result.clients
    metrics = {"accuracy": float(c.accuracy), "loss": float(c.test[c.chosen].loss), "chosen": float(c.candidates[c.chosen]),
               "global-accuracy": float(c.test[0].accuracy) if result.candidate_label else float(c.accuracy),
               "test-samples": len(site.data.clients[0].test), "has-state": int(state is not None)}
    held, glob = site.data.global_test, algorithm.global_model(server)  # None: the method has no global model (FedPer)
    if site.census is not None and len(held) and glob is not None:  # own files: the global model on this site's share of the global test set
        scores = evaluate_model(algorithm, glob, held, int(cfg.get("batch-size", 256)), 10)
        metrics.update({"holdout-accuracy": float(scores.accuracy), "holdout-samples": len(held)})
        if "champion" in msg.content:  # the gate: the promoted version's global model on the same samples
            champion = algorithm.global_model(ServerState(check_upload("the champion", server.global_params, msg.content["champion"])))
            metrics["champion-holdout-accuracy"] = float(evaluate_model(algorithm, champion, held, int(cfg.get("batch-size", 256)), 10).accuracy)
    if site.census is not None:  # own files: keep what serving this site's own models needs (`fedpipe site serve`)
        keep_for_serving(site.folder, spec.to_json(), site.client_id, site.census["name"], int(c.chosen), float(c.candidates[c.chosen]),
                         float(c.accuracy), site.census.get("labels"), site.census.get("snapshot"), server.global_params)
    return Message(RecordDict({"metrics": MetricRecord(inflated_evaluation(metrics))}), reply_to=msg)
