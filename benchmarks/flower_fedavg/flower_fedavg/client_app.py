"""The ClientApp: train the downloaded model on this site's folder (node config `site-dir`) and send it back.

Two layouts of the same TRAIN message: the Message API's (`arrays` + `config`, what `flwr.serverapp.strategy.FedAvg`
sends) and the legacy FitIns layout that `SecAggPlusWorkflow` sends, whose reply `secaggplus_mod` reads as a FitRes
and masks before it leaves the site (Flower's flower-secure-aggregation example, in the Message-API ClientApp).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from flower_fedavg.task import TwoNN, load_site, train

app = ClientApp()


def secagg_when_asked(msg: Message, ctxt: Context, call_next):
    """secaggplus_mod expects its stage on every TRAIN message; the plain FedAvg rounds carry none."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


@app.train(mods=[secagg_when_asked])
def fit(msg: Message, context: Context) -> Message:
    rc = context.run_config
    torch.set_num_threads(1)
    x, y = load_site(str(context.node_config["site-dir"]))
    model = TwoNN(int(rc["input-size"]), int(rc["num-classes"]))
    legacy = "arrays" not in msg.content.array_records
    if legacy:
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        names = list(model.state_dict())
        model.load_state_dict({k: torch.from_numpy(a) for k, a in zip(names, parameters_to_ndarrays(fitins.parameters))})
        server_round = int(fitins.config["server-round"])
    else:
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        server_round = int(msg.content["config"]["server-round"])
    # a seed per (run seed, round, site): the same from run to run (node ids are not), different at each site
    site = int(json.loads((Path(str(context.node_config["site-dir"])) / "site.json").read_text())["client_id"])
    seed = int(rc["seed"]) * 1_000_003 + server_round * 10_007 + site
    loss = train(model, x, y, rc, server_round, seed)
    n = len(y)
    if legacy:
        params = ndarrays_to_parameters([t.detach().numpy() for t in model.state_dict().values()])
        res = FitRes(Status(Code.OK, ""), params, n, {"loss": loss})
        return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": n, "loss": loss})})
    return Message(content, reply_to=msg)
