"""Run in the Flower environment by test_census_wait.py: `server_app.wait_for_sites` against a stand-in of Flower's
Grid (push_messages / pull_messages / get_node_ids, flwr/serverapp/grid/grid.py), whose sites answer the census query
with their names at once. Prints one JSON line: per case the census names, or the error's type and text."""

import json
import sys

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedpipe.federation import server_app


class Grid:
    def __init__(self, names: list[str]):
        self.nodes = {100 + k: name for k, name in enumerate(names)}
        self.sent: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for k, m in enumerate(messages):
            mid = f"m{len(self.sent)}-{k}"
            self.sent[mid] = m
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in ids:
            asked = self.sent.pop(mid)
            name = self.nodes[asked.metadata.dst_node_id]
            census = {"name": name, "labels": ["0", "1"], "input_shape": [1, 8, 8], "num_classes": 2, "counts": None,
                      "snapshot": {"digest": "ab"}}
            text = json.dumps(census)
            if name.startswith("classes-"):  # an audit's dishonest sites: 10^6 classes, malformed JSON
                text = json.dumps({**census, "num_classes": 10**6})
            elif name.startswith("json-"):
                text = text[:-7]
            samples = json.dumps({"train": 10, "test": 4, "holdout": 5})
            reply = Message(RecordDict({"site": ConfigRecord({"client-id": -1, "opt-out": False, "census": text, "samples": samples})}),
                            reply_to=asked)
            reply.metadata.__dict__["_reply_to_message_id"] = mid  # the stand-in's message ids are its own
            out.append(reply)
        return out


TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # what flwr-serverapp sets (run_serverapp.py)
results = []
for connected, expected, named, timeout in json.loads(sys.argv[1]):  # each case: its sites, the count, the names, the timeout
    try:
        roster, _, census = server_app.wait_for_sites(Grid(connected), expected, timeout, None, tuple(named))
        results.append({"names": [s.name for s in census.sites], "refused": list(census.refused),
                        "samples": [s.samples.train for s in census.sites]})
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.append({"error": type(e).__name__, "message": str(e)})
print(json.dumps(results))
