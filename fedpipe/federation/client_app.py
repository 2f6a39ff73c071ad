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

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedpipe.engine.clients import ClientTrainer, ClientWork
from fedpipe.federation.sites import Site
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
    work = ClientWork(site.client_id, download, site.load_state(phase.name, DEVICE))
    (outcome,) = trainer.train([work], round_, lr)
    reply: dict = {}
    metrics = {"num-samples": outcome.num_samples}
    if outcome.error:
        reply["error"] = ConfigRecord({"message": outcome.error})
    else:
        site.save_state(phase.name, outcome.new_state)  # stays here
        if outcome.upload is not None:
            reply["upload"] = to_record(outcome.upload)
        metrics.update({"loss": float(outcome.stats.loss), "samples": int(outcome.stats.samples)})
    reply["metrics"] = MetricRecord(metrics)
    return Message(RecordDict(reply), reply_to=msg)
