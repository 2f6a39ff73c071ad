"""The ServerApp: Flower's FedAvg over every connected site, each round timed and its bytes counted.

Without SecAgg+: the Message-API strategy `flwr.serverapp.strategy.FedAvg` (`strategy.start`). With SecAgg+: Flower's
legacy path, `DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))` over a `LegacyContext` holding the legacy
`flwr.server.strategy.FedAvg` (the only way Flower 1.42 offers SecAgg+; docs/federation.md "Secure aggregation").

Measurement: the Grid is wrapped so that every message sent and every reply received is counted, as array bytes
(the ArrayRecords' data, what fedpipe's rounds.jsonl counts) and as message bytes (the content serialised to
protobuf as it travels, SecAgg+'s keys, shares and masked vectors included). A round runs from the strategy's
configure call to its aggregate call; one JSON line per round goes to OUT/rounds.jsonl, then OUT/result.json
(OUT/error.json on a failure, which the benchmark waits on like the try-out does).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.serde import recorddict_to_proto
from flwr.server import ServerConfig
from flwr.server import strategy as legacy
from flwr.server.compat import LegacyContext
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flower_fedavg.task import TwoNN

app = ServerApp()


class MeteredGrid:
    """The Grid, counting the bytes of what goes to the sites (down) and what comes back (up)."""

    def __init__(self, grid: Grid, out: Path):
        self._grid, self.out = grid, out
        self.count = {"bytes_down": 0, "bytes_up": 0, "message_bytes_down": 0, "message_bytes_up": 0, "messages": 0}
        self.mark: dict | None = None

    def __getattr__(self, name):  # get_node_ids, push_messages, ... as the Grid has them
        return getattr(self._grid, name)

    def _add(self, msg: Message, way: str) -> None:
        content = msg.content
        self.count[f"bytes_{way}"] += sum(len(a.data) for rec in content.array_records.values() for a in rec.values())
        self.count[f"message_bytes_{way}"] += recorddict_to_proto(content).ByteSize()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            self._add(m, "down")
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            if not r.has_error():
                self._add(r, "up")
        self.count["messages"] += len(messages) + len(replies)
        return replies

    def round_start(self) -> None:
        self.mark = {**self.count, "t": time.perf_counter()}

    def round_end(self, server_round: int, clients: int, failures: int, loss: float | None) -> None:
        line = {k: v - self.mark[k] for k, v in self.count.items()}
        line.update(round=server_round, clients=clients, failed=failures, loss=loss, seconds=time.perf_counter() - self.mark["t"])
        with open(self.out / "rounds.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


class TimedFedAvg(FedAvg):
    def __init__(self, meter: MeteredGrid, **kwargs):
        super().__init__(**kwargs)
        self.meter = meter

    def configure_train(self, server_round, arrays, config, grid):
        self.meter.round_start()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        ok = sum(not r.has_error() for r in replies)
        self.meter.round_end(server_round, ok, len(replies) - ok, float(metrics["loss"]) if metrics and "loss" in metrics else None)
        return arrays, metrics


class TimedLegacyFedAvg(legacy.FedAvg):
    def __init__(self, meter: MeteredGrid, **kwargs):
        super().__init__(**kwargs)
        self.meter = meter

    def configure_fit(self, server_round, parameters, client_manager):
        self.meter.round_start()  # SecAggPlusWorkflow calls this at the start of its setup stage
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        params, metrics = super().aggregate_fit(server_round, results, failures)  # after the unmask stage
        if params is not None:  # SecAgg+ dequantises to float64: keep the model's float32 (else round 2 on sends 2x)
            params = ndarrays_to_parameters([a.astype(np.float32) for a in parameters_to_ndarrays(params)])
        n = sum(r.num_examples for _, r in results)
        losses = [r.metrics["loss"] * r.num_examples for _, r in results if "loss" in r.metrics]
        self.meter.round_end(server_round, len(results), len(failures), sum(losses) / n if n and len(losses) == len(results) else None)
        return params, metrics


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    out = Path(str(rc["out-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    try:
        run(grid, context, out)
        (out / "result.json").write_text(json.dumps({"rounds": int(rc["num-rounds"])}))
    except BaseException as e:
        (out / "error.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise


def run(grid: Grid, context: Context, out: Path) -> None:
    rc = context.run_config
    torch.set_num_threads(1)
    torch.manual_seed(int(rc["seed"]))
    model = TwoNN(int(rc["input-size"]), int(rc["num-classes"]))
    sites, rounds, timeout = int(rc["num-sites"]), int(rc["num-rounds"]), float(rc["timeout"])
    meter = MeteredGrid(grid, out)
    deadline = time.monotonic() + timeout
    while len(list(grid.get_node_ids())) < sites:  # every site every round, as in fedpipe's runs
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(grid.get_node_ids()))} of {sites} sites connected within {timeout:.0f}s")
        time.sleep(0.5)
    if not rc["secagg"]:
        strategy = TimedFedAvg(meter, fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=sites, min_available_nodes=sites)
        strategy.start(meter, ArrayRecord(model.state_dict()), num_rounds=rounds, timeout=timeout, train_config=ConfigRecord())
        return
    params = ndarrays_to_parameters([t.detach().numpy() for t in model.state_dict().values()])
    strategy = TimedLegacyFedAvg(meter, fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=sites, min_available_clients=sites,
                                 initial_parameters=params, on_fit_config_fn=lambda r: {"server-round": r})
    shares, threshold = float(rc["num-shares"]), float(rc["reconstruction-threshold"])
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
        num_shares=int(shares) if shares.is_integer() else shares,  # an int counts sites, a float is a fraction
        reconstruction_threshold=int(threshold) if threshold.is_integer() else threshold,
        max_weight=float(rc["max-weight"]), clipping_range=float(rc["clipping-range"]),
        quantization_range=int(rc["quantization-range"]), timeout=timeout))
    workflow(meter, LegacyContext(context=context, config=ServerConfig(num_rounds=rounds, round_timeout=timeout), strategy=strategy))
