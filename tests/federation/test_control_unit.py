"""The Control API's token guard (fedpipe.federation.control) and the ServerApp's places (fedpipe.federation.places),
without Flower processes. The live checks are tests/federation/test_loopback.py's (a process without the try-out's
token, a run config naming an outside folder or store)."""

from __future__ import annotations

import asyncio
import os

import pytest

from fedpipe.federation.control import (
    HEADER,
    TOKEN_ENV,
    ControlTokenError,
    ControlTokenGuard,
    cli_command,
    is_control_path,
    make_token,
    read_token,
)
from fedpipe.federation.places import PREFIX_ENV, ROOT_ENV, STORE_ENV, PlaceRefused, local_place, store_place

TOKEN = "t" * 43


def _call(path: str, headers: dict[str, str] | None = None) -> tuple[int, bool]:
    """(status, whether Flower's app was reached) of one request through the guard."""
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": path, "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(ControlTokenGuard(app, token=TOKEN)(scope, receive, send))
    return sent[0]["status"], bool(reached)


@pytest.mark.parametrize("path", ["/v1/control/register-node", "/v1/control/start-run", "//v1/control/list-nodes",
                                  "/V1/Control/list-nodes", "/v1//control/start-run", "/v1/control"])
def test_a_control_call_without_the_token_never_reaches_flower(path):
    assert _call(path) == (403, False)
    assert _call(path, {HEADER: "wrong" + TOKEN[5:]}) == (403, False)
    assert _call(path, {HEADER: TOKEN}) == (200, True)


@pytest.mark.parametrize("path", ["/v1/fleet/activate-node", "/v1/fleet/pull-messages", "/health", "/v1/runtime/acquire-task",
                                  "/v1/controller", "/docs"])
def test_the_fleet_and_runtime_apis_are_untouched(path):
    """Sites (Fleet API) and the SuperLink's own ServerApps (Runtime API) carry no token and need none."""
    assert is_control_path(path) is False
    assert _call(path) == (200, True)


def test_a_token_file_is_private_long_and_fresh(tmp_path):
    path = make_token(tmp_path / "control")
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert len(read_token(path)) >= 32 and read_token(path) != read_token(make_token(tmp_path / "control"))
    path.chmod(0o644)
    with pytest.raises(ControlTokenError, match="readable by every user"):
        read_token(path)
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ControlTokenError, match="fewer than 32"):
        read_token(short)
    with pytest.raises(ControlTokenError, match=f"{TOKEN_ENV} is not set"):
        read_token(None)


def test_flwr_runs_through_the_guarded_cli_only_when_a_token_is_named(tmp_path):
    flwr = tmp_path / "bin" / "flwr"
    assert cli_command(flwr, {}) == [str(flwr)]
    assert cli_command(flwr, {TOKEN_ENV: "/x"}) == [str(tmp_path / "bin" / "python"), "-m", "fedpipe.federation.control", "flwr"]


# --- the ServerApp's places --------------------------------------------------------------------------------------


def test_a_local_place_must_lie_below_the_deployments_root(tmp_path):
    root = tmp_path / "tryout"
    (root / "out").mkdir(parents=True)
    env = {ROOT_ENV: str(root)}
    assert local_place(str(root / "out"), "out-dir", env) == (root / "out").resolve()
    assert local_place(str(root / "new" / "spec.json"), "spec-file", env) == (root / "new" / "spec.json").resolve()
    for outside in (str(tmp_path / "elsewhere"), "/etc", str(root) + "-sibling"):
        with pytest.raises(PlaceRefused, match=f"outside {root.resolve()}.*{ROOT_ENV}"):
            local_place(outside, "out-dir", env)
    for odd in (f"{root}/out/../../elsewhere", "relative/out", ""):
        with pytest.raises(PlaceRefused):
            local_place(odd, "out-dir", env)
    (root / "link").symlink_to(tmp_path)  # a symlink inside the root that leads out of it
    with pytest.raises(PlaceRefused, match="outside"):
        local_place(str(root / "link" / "out"), "out-dir", env)
    with pytest.raises(PlaceRefused, match=f"{ROOT_ENV} is unset"):
        local_place(str(root / "out"), "out-dir", {})


def test_a_store_run_must_name_the_deployments_store_and_a_runs_prefix(tmp_path):
    env = {STORE_ENV: "s3://mlpipeline/fedpipe, " + str(tmp_path / "shared")}
    assert store_place("s3://mlpipeline/fedpipe/", "run-1/federation", env) == ("s3://mlpipeline/fedpipe/", "run-1/federation")
    assert store_place(str(tmp_path / "x" / ".." / "shared"), "run-1/federation", env)[1] == "run-1/federation"
    with pytest.raises(PlaceRefused, match=f"not .*{STORE_ENV}"):
        store_place("s3://other-bucket/fedpipe", "run-1/federation", env)
    with pytest.raises(PlaceRefused, match=f"not .*{STORE_ENV}"):
        store_place(str(tmp_path / "elsewhere"), "run-1/federation", env)
    for prefix in ("run-1", "../run-1/federation", "/run-1/federation", "a//federation", "run-1/./federation", "federation"):
        with pytest.raises(PlaceRefused, match="not a run's federation prefix"):
            store_place("s3://mlpipeline/fedpipe", prefix, env)
    with pytest.raises(PlaceRefused, match=f"{STORE_ENV} is unset"):
        store_place("s3://mlpipeline/fedpipe", "run-1/federation", {})
    team = {**env, PREFIX_ENV: "team-a/"}
    assert store_place("s3://mlpipeline/fedpipe", "team-a/run-1/federation", team)
    with pytest.raises(PlaceRefused, match=f"not below team-a/.*{PREFIX_ENV}"):
        store_place("s3://mlpipeline/fedpipe", "team-b/run-1/federation", team)


SERVERAPP_MAIN = """
import json, sys
from fedpipe.federation import server_app
from fedpipe.federation.places import PlaceRefused

class Context:
    run_config = json.loads(sys.argv[1])

try:
    server_app.main(None, Context())  # no grid: a run that got past the places would fail at once, after its deletions
except PlaceRefused as e:
    print("refused:", e)
"""


@pytest.mark.federation
@pytest.mark.timeout(300)
def test_the_serverapp_refuses_before_it_deletes_or_writes(tmp_path, flower_env):
    """fedpipe's ServerApp `main` (in the Flower environment, run config as a SuperLink would hand it) with an out-dir
    outside FEDPIPE_SERVER_ROOT: refused, and that folder's result.json (which main removes as stale before a run, the
    audit's deleted file) is still there; with a store that is not FEDPIPE_SERVER_STORE: refused, nothing created."""
    import json
    import subprocess
    from pathlib import Path

    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "result.json").write_text("kept")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), ROOT_ENV: str(tmp_path / "root")}
    env.pop(STORE_ENV, None)
    said = {}
    for what, config in {"out-dir": {"out-dir": str(tmp_path / "outside"), "spec-file": str(tmp_path / "root" / "spec.json")},
                         "store": {"store": str(tmp_path / "outside-store"), "prefix": "run-1/federation"}}.items():
        r = subprocess.run([str(flower_env / "bin" / "python"), "-c", SERVERAPP_MAIN, json.dumps(config)], capture_output=True,
                           text=True, env=env, timeout=200)
        said[what] = r.stdout + r.stderr
    assert f"refused: run config out-dir='{tmp_path / 'outside'}'" in said["out-dir"], said["out-dir"][-2000:]
    assert "refused: run config store=" in said["store"] and STORE_ENV in said["store"], said["store"][-2000:]
    assert os.listdir(tmp_path / "outside") == ["result.json"] and (tmp_path / "outside" / "result.json").read_text() == "kept"
    assert not (tmp_path / "outside-store").exists()


def test_the_guarded_superlink_does_not_start_without_a_usable_token_or_beside_a_second_control_api(tmp_path, monkeypatch, capsys):
    """`python -m fedpipe.federation.control superlink`: no token file, or Flower's legacy gRPC Control API asked for
    (FLWR_INTERNAL_GRPC_CONTROL_API=1, flwr/superlink/cli/flower_superlink.py, which the guard does not cover): exit 2
    before Flower is imported."""
    from fedpipe.federation.control import main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert main(["superlink", "--", "--insecure"]) == 2 and f"{TOKEN_ENV} is not set" in capsys.readouterr().err
    monkeypatch.setenv(TOKEN_ENV, str(make_token(tmp_path / "control")))
    monkeypatch.setenv("FLWR_INTERNAL_GRPC_CONTROL_API", "1")
    assert main(["superlink", "--", "--insecure"]) == 2 and "FLWR_INTERNAL_GRPC_CONTROL_API" in capsys.readouterr().err
    assert main(["nothing"]) == 2
