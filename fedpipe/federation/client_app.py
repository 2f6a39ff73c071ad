"""fedpipe's ClientApp: a site's side of a federated round, run by the site's SuperNode.

Flower 1.42 API used (flwr/clientapp/client_app.py): `ClientApp()` with `@app.train()` and `@app.query()`
handlers `(msg: Message, context: Context) -> Message`; the reply is `Message(content, reply_to=msg)`
(flwr/app/message/message.py). The site's folder comes from the SuperNode's node config
(`flower-supernode --node-config 'site-dir="..."'`, read as `context.node_config["site-dir"]`).

The site trains with `fedpipe.engine.clients.ClientTrainer`, the code the simulation trains every client
with; the algorithm object is built from the spec the server sends (`FederationSpec`), so there is no
second copy of any update rule. It returns only what the method's `client_result` uploads; the
personal state it returns is saved in the site's own folder (`Site.save_state`) and never sent.
"""

from __future__ import annotations

import logging
import sys
import time

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedpipe.algorithms.base import ServerState
from fedpipe.engine.clients import ClientTrainer, ClientWork
from fedpipe.engine.evaluation import evaluate_personalized
from fedpipe.federation.faults import corrupt, injected_fault
from fedpipe.federation.sites import Site, state_digest
from fedpipe.federation.spec import FederationSpec
from fedpipe.federation.transport import from_record, to_record

log = logging.getLogger(__name__)
app = ClientApp()
DEVICE = torch.device("cpu")

def _site(context: Context, spec: FederationSpec | None = None) -> Site:
    folder = str(context.node_config["site-dir"])
    shape = tuple(spec.input_shape) if spec else (1,)
    return Site(folder, DEVICE, spec.num_classes if spec else 0, shape)


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Which client this site is (the server maps its client ids to Flower node ids with it)."""
    site = _site(context)
    return Message(RecordDict({"site": ConfigRecord({"client-id": site.client_id, "opt-out": site.opt_out})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = msg.content["config"]
    spec = FederationSpec.from_json(str(cfg["spec"]))
    torch.set_num_threads(spec.threads)
    phase = spec.phase(str(cfg["phase"]))
    round_, lr = int(cfg["round"]), float(cfg["lr"])
    site = _site(context, spec)
    algorithm, _ = spec.build(DEVICE)
    trainer = ClientTrainer(algorithm, phase, site.data, spec.train_cfg, spec.engine_cfg, spec.seed)
    download = from_record(msg.content["download"], DEVICE)
    names = [p.name for p in spec.phases()]
    state = site.load_state(phase.name, DEVICE, tuple(names[:names.index(phase.name)]))
    fault = injected_fault(round_)
    if fault == "hang":
        print(f"fault injector: site {site.client_id} hangs in round {round_}", file=sys.stderr, flush=True)
        time.sleep(3600)
    work = ClientWork(site.client_id, download, state)
    (outcome,) = trainer.train([work], round_, lr)
    reply: dict = {}
    # state-in: a digest of the personal state this round started from (0: none), so a test can tell a site
    # that rejoined with its state from one that started afresh; the state itself never leaves the site
    metrics = {"num-samples": outcome.num_samples, "state-in": state_digest(state)}
    if outcome.error:
        reply["error"] = ConfigRecord({"message": outcome.error})
    else:
        site.save_state(phase.name, outcome.new_state)  # stays here
        if outcome.upload is not None:
            upload = corrupt(outcome.upload, fault) if fault else outcome.upload
            reply["upload"] = to_record(upload)
        metrics.update({"loss": float(outcome.stats.loss), "samples": int(outcome.stats.samples),
                        "state-out": state_digest(outcome.new_state)})
    reply["metrics"] = MetricRecord(metrics)
    return Message(RecordDict(reply), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The site's own evaluation: the method's personalized candidates (SuPerFed: the lam grid between the global
    model it downloads and the local model in its store), chosen on its validation split, scored on its test
    split, by `fedpipe.engine.evaluation.evaluate_personalized`, the simulation's evaluation. Only scores leave."""
    cfg = msg.content["config"]
    spec = FederationSpec.from_json(str(cfg["spec"]))
    torch.set_num_threads(spec.threads)
    site = _site(context, spec)
    algorithm, _ = spec.build(DEVICE)
    server = ServerState(from_record(msg.content["download"], DEVICE))
    names = [p.name for p in spec.phases()]
    state = site.load_state(names[-1], DEVICE, tuple(names[:-1]))
    states = {site.client_id: state} if state is not None else {}
    result = evaluate_personalized(algorithm, server, states, site.data, int(cfg.get("batch-size", 256)), 10)
    (c,) = result.clients
    metrics = {"accuracy": float(c.accuracy), "loss": float(c.test[c.chosen].loss), "chosen": float(c.candidates[c.chosen]),
               "global-accuracy": float(c.test[0].accuracy) if result.candidate_label else float(c.accuracy),
               "test-samples": len(site.data.clients[0].test), "has-state": int(state is not None)}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
