"""A site's warm worker: one long-lived process that answers the site's Flower SuperNode with fedpipe's own code, and
nothing else, under the site's own policy.

Why: in its default (subprocess) isolation, Flower 1.42's SuperNode has its SuperExec start a new `flwr-clientapp`
process for every message, and that process installs the submitted FAB and imports the ClientApp the FAB's own
pyproject names, from the FAB's own Python files (flwr/supernode/runtime/run_clientapp.py). So whoever can submit a
run executes code next to the site's data, and each message pays a process start, torch's import and the site's
splits read again. Here the SuperNode runs with `--isolation process` (flwr/supernode/cli/flower_supernode.py: "a
separate independent process gets created outside of SuperNode") and this worker is that process, speaking the
SuperNode's Runtime API as Flower's own SuperExec and `flwr-clientapp` do, but in one process:

1. `AcquireTask` (flwr/supercore/superexec/run_superexec.py's loop; signed with the SuperExec HMAC,
   flwr/supercore/interceptors/http/superexec_auth.py, from a secret only this worker and its SuperNode hold) hands
   out a pending ClientApp task and its token;
2. with the token, `PullTaskInput` and `PullMessages` give the run, the FAB, the context and the message
   (`flwr.supernode.runtime.run_clientapp.pull_task_input`), while a heartbeat keeps the task alive;
3. the FAB is checked to be fedpipe's own app (`fedpipe.federation.app.check_fab`) and the message against the site's
   policy (`fedpipe.federation.policy`), before any data is read: a refusal is the reply, naming the rule;
4. fedpipe's ClientApp object (`fedpipe.federation.client_app.app`, imported from the fedpipe installed here, never
   from the FAB) answers the message, under the policy's time limit per round;
5. `PushMessages`/`PushObject` and `PushTaskOutput` return the reply and the context (`push_message`,
   `push_task_output` of the same Flower module), and the task is done.

torch, fedpipe and the site's prepared splits stay loaded between messages (`client_app` keeps the run's site); the
personal state is still written to the site's folder every round, so a killed worker resumes as before. The worker
starts its SuperNode as a child that dies with it (PR_SET_PDEATHSIG), and exits when the SuperNode does, so a
supervisor (Kubernetes, the try-out) restarts the pair.

Every message taken or refused is a line of the site's own log (`messages.jsonl` in its folder: run, method, kind,
round, what left the site in bytes), which `fedpipe site check --state` sums up.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node
from flwr.proto.runtime_pb2 import AcquireTaskRequest, PullAppMessagesRequest, PullTaskInputRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

from fedpipe.federation import client_app, site_log  # torch and fedpipe's ClientApp, imported once, before any task
from fedpipe.federation.app import AppRefused, check_fab, run_name
from fedpipe.federation.policy import SitePolicy
from fedpipe.federation.secagg import message_bytes
from fedpipe.federation.supernode import GROWTH, PULL_BACKOFF, PULL_BACKOFF_CAP

log = logging.getLogger("fedpipe.site")
SECRET_FILE = "superexec-secret"  # the HMAC secret this worker and its SuperNode share (in the site's folder, mode 600)
ACQUIRE = "/flwr.proto.Runtime/AcquireTask"


class Refused(Exception):
    """A message this site will not answer (the policy, or an app that is not fedpipe's)."""


class TooLong(Exception):
    """The round ran past the policy's seconds."""


class SiteWorker:
    """The loop: acquire a task, check it, answer it with fedpipe's ClientApp, push the reply; `poll` seconds before
    the first acquisition after a task (Flower's SuperExec polls every second, FLWR_SUPEREXEC_TASK_POLL_INTERVAL)."""

    def __init__(self, runtime_api: str, secret: bytes, policy: SitePolicy, name: str, superlink: str, folder: Path,
                 poll: float = 0.02):
        self.runtime_api, self.secret, self.policy, self.name = runtime_api, secret, policy, name
        self.superlink, self.folder, self.poll = superlink, folder, poll
        self.specs: dict[int, object] = {}  # run id -> the spec its messages carried (SecAgg+'s key stages carry none)

    def client(self, token: str | None = None) -> RuntimeHttpClient:
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec" if token is None else "flwr-clientapp")]
        interceptors.append(RuntimeTokenHttpInterceptor(token) if token is not None else
                            SuperExecAuthHttpInterceptor(master_secret=self.secret, protected_methods={ACQUIRE}))
        retry = make_simple_http_retry_invoker()
        if token is None:  # the acquirer does not retry: the loop asks again and meanwhile sees its SuperNode exit
            retry.max_tries = 1
        return RuntimeHttpClient.from_server_address(server_address=self.runtime_api, insecure=True, root_certificates=None,
                                                     interceptors=interceptors, retry_invoker=retry)

    def acquire(self, acquirer: RuntimeHttpClient) -> str | None:
        """The token of a pending ClientApp task, or None (none pending, or the SuperNode not answering yet)."""
        try:
            res = acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        except Exception as e:  # the SuperNode is starting or restarting: its Runtime API answers soon
            log.debug("AcquireTask: %s", e)
            time.sleep(0.5)
            return None
        return res.token if res.HasField("task") and res.token else None

    def serve(self, alive=lambda: True) -> None:
        """Take tasks until `alive()` is false (the SuperNode exited). Between tasks the worker asks every `poll`
        seconds at first, then a quarter longer each time up to 1 s (as its SuperNode's `PullClock` does): a site
        that just answered takes the round's next message at once, an idle one costs its machine little."""
        acquirer, token, wait = self.client(), None, self.poll
        while alive():
            token = token or self.acquire(acquirer)
            if token is None:
                time.sleep(wait)
                wait = min(wait * GROWTH, 1.0)
                continue
            token, wait = self.take(token, acquirer), self.poll

    def take(self, token: str, acquirer: RuntimeHttpClient) -> str | None:
        """One task: pull its inputs, check them, answer, push the reply and the context. Returns the token of the next
        task when this one was abandoned (see `pull`), else None."""
        client = self.client(token)
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        context, status, details, t0 = None, SubStatus.FAILED, "", time.monotonic()
        try:
            inputs, next_token = self.pull(client, acquirer)
            if inputs is None:
                details = "abandoned: its message's content never reached this site (its run had ended)"
                return next_token
            message, context, run, fab = inputs
            t1 = time.monotonic()
            entry = {"run": run_name(context.run_config), "flower_run": int(run.run_id), "kind": _kind(message),
                     "pull_s": round(t1 - t0, 4)}
            try:
                reply, entry = self.answer(message, context, fab.content, entry)
                entry["answer_s"] = round(time.monotonic() - t1, 4)
                status = SubStatus.COMPLETED
            except Refused as e:
                details = f"{self.name} refused: {e}"
                reply, entry = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message), \
                    {**entry, "decision": "refused", "reason": str(e)}
                log.warning("%s", details)
            except Exception as e:  # fedpipe's own handler failed: Flower's error reply, as flwr-clientapp sends
                details = f"{type(e).__name__}: {e}"
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{self.name}: {details}"), reply_to=message)
                entry = {**entry, "decision": "failed", "reason": details[:500]}
                log.exception("the ClientApp raised")
            t2 = time.monotonic()
            push_message(client, reply, context)
            site_log.append(self.folder, {**entry, "bytes_out": message_bytes(reply), "push_s": round(time.monotonic() - t2, 4),
                                          "seconds": round(time.monotonic() - t0, 4)})
            return None
        finally:
            push_task_output(client, context, status, details)
            heartbeat.stop()
            client.close()

    def pull(self, client: RuntimeHttpClient, acquirer: RuntimeHttpClient) -> tuple[tuple | None, str | None]:
        """The task's inputs (`pull_task_input`: message, context, run, FAB), or (None, the next task's token) when the
        SuperNode has moved on. Flower's SuperNode creates a task before it pulls the message's content from the
        SuperLink, and drops the content of a message whose run stopped meanwhile (flwr/supernode/start_client_internal.py,
        `_pull_and_store_message`: RunNotRunningException), leaving a task whose content never comes; Flower's inflate
        would wait for it up to 2 hours (PULL_MAX_TIME). Flower runs one process per task, so that one just hangs; this
        worker pulls in a thread and, since the SuperNode answers one message at a time (it waits for a reply before it
        pulls the next, `_push_messages`), takes a new pending task as the sign that the current one is abandoned."""
        got: dict = {}

        def run():
            try:
                got["inputs"] = pull_task_input(client)
            except Exception as e:  # noqa: BLE001  (raised again in the worker's thread)
                got["error"] = e

        thread = threading.Thread(target=run, daemon=True, name="pull-task-input")
        thread.start()
        thread.join(2.0)
        while thread.is_alive():
            next_token = self.acquire(acquirer)
            if next_token is not None:
                log.warning("a task's message never arrived (its run ended before the SuperNode had it): abandoned")
                return None, next_token
            thread.join(0.5)
        if "error" in got:
            raise got["error"]
        return got["inputs"], None

    def answer(self, message: Message, context, fab: bytes, entry: dict) -> tuple[Message, dict]:
        """fedpipe's ClientApp's reply to `message`, if the app is fedpipe's and the policy allows it (Refused if not)."""
        try:
            check_fab(fab, dict(context.run_config))
        except AppRefused as e:
            raise Refused(str(e)) from None
        spec = _spec_of(message) or self.specs.get(context.run_id)
        if spec is None:
            raise Refused("a message of a run whose spec it has not seen (the census sends it first)")
        self.specs = {**{k: v for k, v in list(self.specs.items())[-15:] if k != context.run_id}, context.run_id: spec}  # the latest runs
        entry = {**entry, "method": spec.method.get("name"), **_round_of(message)}
        why = self.policy.refusal(spec, entry["run"], self.superlink, entry["kind"])
        if why:
            raise Refused(why)
        limits = self.policy.limits
        client_app.SETTINGS = client_app.SiteSettings(limits.max_threads, self.policy.release.label_counts, limits.max_cache_mb,
                                                        self.policy.opt_out)
        # the policy's seconds a round bound training and evaluation; the census (the site's first reading of its files) is not a round
        limit = limits.max_train_seconds if entry["kind"] != "census" else 0
        previous = signal.signal(signal.SIGALRM, _too_long)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            reply = client_app.app(message=message, context=context)
        except TooLong:
            raise Refused(f"the round ran past its {limit:g} s") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return reply, {**entry, "decision": "error" if reply.has_error() else "took"}


def pull_task_input(client: RuntimeHttpClient):
    """The task's (message, context, run, FAB): Flower's own steps (flwr/supernode/runtime/run_clientapp.py,
    `pull_task_input`: PullTaskInput, PullMessages, then the message's objects inflated from its tree), with shorter
    waits between the pulls of an object that has not arrived yet (`supernode.PULL_BACKOFF`: the SuperNode creates the
    task before the message's content has come from the SuperLink)."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode handed out a task without a message")
    tree, node = pulled.message_object_trees[0], Node(node_id=context.node_id)
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=PULL_BACKOFF, backoff_cap=PULL_BACKOFF_CAP)
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower does: the tree's head is the message's id
    return message, context, run, fab


def _too_long(signum, frame):
    raise TooLong()


def _kind(message: Message) -> str:
    kind = str(message.metadata.message_type)
    return {"query": "census", "train": "train", "evaluate": "evaluate"}.get(kind, kind)


def _configs(message: Message):
    if not message.has_content():
        return []
    return list(message.content.config_records.values())


def _spec_of(message: Message):
    """The run's spec in `message` (its config, its census ask, or the legacy FitIns config of a SecAgg+ round)."""
    from fedpipe.federation.spec import FederationSpec

    for record in _configs(message):
        if "spec" in record:
            try:
                return FederationSpec.from_json(str(record["spec"]))
            except (ValueError, TypeError) as e:
                raise Refused(f"the message's spec is not fedpipe's ({type(e).__name__})") from None
    return None


def _round_of(message: Message) -> dict:
    for record in _configs(message):
        if "round" in record:
            return {"round": int(record["round"]), **({"phase": str(record["phase"])} if "phase" in record else {})}
    return {}


# --- the process: the SuperNode as a child, the worker in front -----------------------------------------------
def _die_with_parent() -> None:
    """In the SuperNode's process before exec: it gets SIGKILL when the worker dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def make_secret(folder: Path) -> Path:
    """A fresh HMAC secret for this start of the site (the previous one is replaced): created O_EXCL, mode 600."""
    path = folder / SECRET_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A fedpipe site's worker (started by `fedpipe site join`): runs its SuperNode in "
                                "process isolation and answers it with fedpipe's own ClientApp, under the site's policy.")
    p.add_argument("--site-dir", type=Path, required=True, help="the site's folder (its splits, state and log)")
    p.add_argument("--runtime-port", type=int, required=True, help="the SuperNode's Runtime API port on 127.0.0.1")
    p.add_argument("--superlink", required=True, help="the SuperLink address the SuperNode joins (checked against the policy)")
    p.add_argument("--policy", type=Path, default=None, help="the site's policy file (YAML; default: the safe defaults)")
    p.add_argument("--name", default="", help="the site's name in its refusals (default: the policy's, else the folder's)")
    p.add_argument("supernode", nargs=argparse.REMAINDER, help="-- then the SuperNode's options (`tryout.supernode_options`)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fedpipe-site %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per Runtime API call (20 a second while idle)
    policy = SitePolicy.read(a.policy)
    name = policy.name or a.name or a.site_dir.name
    why = policy.serves(a.superlink)
    if why:
        print(f"{name}: {why}: the site's policy ({a.policy}) does not let it join", file=sys.stderr)
        return 2
    options = a.supernode[1:] if a.supernode[:1] == ["--"] else a.supernode
    a.site_dir.mkdir(parents=True, exist_ok=True)
    secret = make_secret(a.site_dir)
    command = [sys.executable, "-m", "fedpipe.federation.supernode", *options, "--isolation", "process",
               "--superexec-auth-secret-file", str(secret)]
    supernode = subprocess.Popen(command, preexec_fn=_die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT):  # stopping the worker stops its SuperNode (it says goodbye to the SuperLink)
        signal.signal(sig, lambda s, f: (supernode.send_signal(signal.SIGTERM), sys.exit(0)))
    worker = SiteWorker(f"127.0.0.1:{a.runtime_port}", secret.read_bytes(), policy, name, a.superlink, a.site_dir)
    log.info("%s: serving its SuperNode (pid %d) with fedpipe's own ClientApp", name, supernode.pid)
    worker.serve(alive=lambda: supernode.poll() is None)
    return supernode.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
