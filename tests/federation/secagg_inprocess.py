"""Run by tests/federation/test_secagg.py in the Flower environment (no SuperLink, no SuperNode): fedpipe's
`SecureSiteRound` drives Flower's real `SecAggPlusWorkflow` against fedpipe's real ClientApp (with Flower's real
`secaggplus_mod`) of each site folder, in this one process, through an in-memory grid that hands each message to the
destination site's ClientApp with that site's own Context (kept across messages, as a SuperNode keeps it).

    python secagg_inprocess.py SPEC_FILE OUT_DIR SITE_DIR... [--fault SITE_INDEX=FAULT@ROUND] [--rounds N]

Every phase of the spec's method runs its rounds up to round N.

Writes OUT_DIR/result.json: per round, the outcomes (client, error) and the secure line rounds.jsonl would get.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.common.serde import message_from_proto, message_to_proto  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedpipe.algorithms.base import ServerState  # noqa: E402
from fedpipe.engine.rounds import run_round  # noqa: E402
from fedpipe.engine.state import PhaseState  # noqa: E402
from fedpipe.federation.client_app import app as client_app  # noqa: E402
from fedpipe.federation.faults import FAULT_INJECTOR_ENV  # noqa: E402
from fedpipe.federation.secagg import SecureSiteRound  # noqa: E402
from fedpipe.federation.server_app import DEVICE, Roster, SiteEntry, SiteRound  # noqa: E402
from fedpipe.federation.spec import FederationSpec  # noqa: E402


class InMemorySites:
    """The Grid API SecureSiteRound uses (get_node_ids, push_messages, pull_messages), over in-process ClientApps."""

    def __init__(self, folders: list[Path], faults: dict[int, str]):
        self.nodes = {1000 + i: f for i, f in enumerate(folders)}
        self.contexts = {n: Context(1, n, {"site-dir": str(f)}, RecordDict(), {}) for n, f in self.nodes.items()}
        self.faults = {1000 + i: v for i, v in faults.items()}
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid  # as flwr/superlink/grid/inmemory_grid.py does
            node = m.metadata.dst_node_id
            os.environ[FAULT_INJECTOR_ENV] = self.faults.get(node, "")
            try:
                # a copy, as the transport delivers one: the workflow sends one content object to every site
                reply = client_app(message_from_proto(message_to_proto(m)), self.contexts[node])
            except Exception as e:  # what Flower's run_clientapp turns an exception into
                from flwr.app import Error
                reply = Message(Error(code=2, reason=f"{type(e)}:<'{e}'>"), reply_to=m)
            finally:
                os.environ.pop(FAULT_INJECTOR_ENV, None)
            reply.metadata.__dict__["_src_node_id"] = node
            self.replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("out")
    p.add_argument("sites", nargs="+")
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--rounds", type=int, default=1)
    a = p.parse_args()
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # what flwr-serverapp sets (run_serverapp.py)
    spec = FederationSpec.read(a.spec)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    faults = {int(k): v for k, v in (f.split("=", 1) for f in a.fault)}
    grid = InMemorySites([Path(s) for s in a.sites], faults)
    roster = Roster([SiteEntry(json.loads((Path(f) / "site.json").read_text())["client_id"], False, n) for n, f in grid.nodes.items()])
    algorithm, initial = spec.build(DEVICE)
    state = PhaseState(spec.method["name"], "init", 0, ServerState(initial), {})
    rounds = []
    for phase in spec.phases():  # every phase's rounds up to --rounds, each phase with its own trainer (as serve does)
        trainer = SiteRound(grid, roster, spec, phase, 60.0, out, algorithm=algorithm)
        if phase.communicates:  # a finetune phase sends nothing to sum: plain rounds, as serve runs them
            trainer = SecureSiteRound(trainer, spec)
        for r in range(phase.first_round, min(phase.last_round, a.rounds) + 1):
            try:
                result = run_round(algorithm, phase, roster, state, spec.train_cfg, spec.seed, trainer, r)
                rounds.append({"round": r, "phase": phase.name, "clients": result.clients, "failed": result.failed_clients,
                               "bytes_up": result.bytes_uploaded, "secure": trainer.secure[r] if phase.communicates else None,
                               "rejected": [x for x in trainer.rejected if x["round"] == r]})
            except Exception as e:
                rounds.append({"round": r, "phase": phase.name, "error": f"{type(e).__name__}: {e}", "secure": getattr(trainer, "secure", {}).get(r),
                               "rejected": [x for x in trainer.rejected if x["round"] == r]})
                (out / "result.json").write_text(json.dumps({"rounds": rounds}, indent=1))
                return
    (out / "result.json").write_text(json.dumps({"rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
