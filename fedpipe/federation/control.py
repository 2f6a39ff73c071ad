"""The SuperLink's Control API is the operator's alone: a token that fedpipe's SuperLink checks on every Control API call,
and the `flwr` CLI run so that it sends it.

Why a token, and why fedpipe adds it (Flower 1.42, flwr/...):
- The Control API (`flwr supernode register`, `flwr run`, `flwr ls`) checks no credential of its own: without Flower's
  enterprise OIDC plugin (FLWR_OIDC_ENABLED=1, which needs `flwr.ee`) the SuperLink loads `NoOpControlAuthnPlugin`
  (superlink/config_loader.py:181-192, superlink/auth_plugin/noop_auth_plugin.py), which accepts every call.
- It shares the SuperLink's one HTTPS port with the Fleet and Runtime APIs (superlink/main.py includes the control,
  fleet and runtime routers in one FastAPI app; superlink/cli/flower_superlink.py:522 `uvicorn.run(host, port)`), so a
  Unix socket or a port of its own is not possible: `--control-api-address` is deprecated and only feeds a legacy gRPC
  server started under FLWR_INTERNAL_GRPC_CONTROL_API=1 (flower_superlink.py:140, 296-319), and its address is parsed as
  host:port (`_format_address`), never `unix:`.
- That uvicorn server is given only the server's key and certificate (flower_superlink.py:522-531: no `ssl_cert_reqs`,
  no `ssl_ca_certs`), and the `flwr` CLI's HTTPS client has no client certificate option (supercore/protobuf/client.py
  `ProtobufClient.from_server_address`: `verify` only), so Flower itself can do no mTLS on the Control API either.

What fedpipe does instead, with the hooks Flower has:
- `guard_superlink`: `python -m fedpipe.federation.control superlink -- <flower-superlink args>` runs Flower's own
  `flower_superlink()` with `ControlTokenGuard` put first in the app's middleware through Flower's extension hook
  (superlink/main.py:102-105: `_get_middleware` puts `extensions.get_middleware()` outermost; superlink/extensions.py
  `get_middleware`). Every request whose path is the Control API's (`/v1/control/...`, superlink/routers/control/
  router.py:126-127) must carry the header `x-fedpipe-control-token` equal to the token in FEDPIPE_CONTROL_TOKEN_FILE;
  anything else gets 403 before Flower sees it. The Fleet and Runtime APIs are untouched (sites and the SuperLink's own
  ServerApps use them). The token file's path is taken out of the environment before Flower starts, so the SuperExec and
  the ServerApps it starts do not inherit it.
- `flwr_cli`: `python -m fedpipe.federation.control flwr <flwr args>` runs Flower's own `flwr` CLI with the header added
  to each Control API request by the interceptor Flower attaches to every one of them (cli/utils.py:370-378,
  cli/cli_client_interceptor.py `CliClientHttpInterceptor.intercept`).

Who holds the token: the try-out writes a fresh one into its own folder (`make_token`: mode 0600 in a 0700 folder), so only
the try-out's own processes (and the same OS user) can use its Control API; on a cluster it is a Secret that the SuperLink
and the pipeline's federation tasks mount (charts/fedpipe). This module imports no Flower module at import time: .venv
writes tokens, the Flower environment runs the two entry points.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
import sys
from pathlib import Path

TOKEN_ENV = "FEDPIPE_CONTROL_TOKEN_FILE"
HEADER = "x-fedpipe-control-token"
CONTROL_PATH = re.compile(r"/+v1/+control(/|$)", re.IGNORECASE)
MIN_TOKEN = 32


class ControlTokenError(RuntimeError):
    """The token file is missing, too short, or readable by others."""


def make_token(folder: str | Path) -> Path:
    """A fresh token in `folder`/control.token, the folder mode 0700 and the file 0600 (the owner alone reads it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / "control.token"
    path.unlink(missing_ok=True)
    return write_token(path)


def write_token(path: str | Path) -> Path:
    """A fresh random token in the new file `path` (mode 0600; refused when it exists)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def read_token(path: str | Path | None, private: bool = True) -> str:
    """The token in `path`; ControlTokenError when there is none, it is shorter than MIN_TOKEN characters, or (`private`:
    the SuperLink's side) the file is readable by every user (a Kubernetes Secret volume mounted with mode 0440 for the
    pod's group is fine). A submitter's copy is not checked for its mode: KFP mounts a task's Secret volume 0644, inside
    a container of its own."""
    if not path:
        raise ControlTokenError(f"{TOKEN_ENV} is not set: the SuperLink's Control API needs the operator's token "
                                "(the try-out makes one; on a cluster the chart's control Secret holds it)")
    path = Path(path)
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as e:
        raise ControlTokenError(f"{TOKEN_ENV}={path}: cannot read the Control API token ({e.strerror})") from None
    if private and mode & stat.S_IROTH:
        raise ControlTokenError(f"{TOKEN_ENV}={path} is readable by every user (mode {stat.S_IMODE(mode):o}): make it 0600 "
                                "(or 0440 for a group), the token is the Control API's only key")
    if len(token) < MIN_TOKEN:
        raise ControlTokenError(f"{TOKEN_ENV}={path} holds {len(token)} characters, fewer than {MIN_TOKEN}: write a random "
                                "token (`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def is_control_path(path: str) -> bool:
    """Whether an ASGI `path` (already percent-decoded by the server) is routed to the Control API, also with doubled
    slashes or other letter case (Starlette routes neither, but the guard does not rely on that)."""
    return bool(CONTROL_PATH.match(path or ""))


class ControlTokenGuard:
    """ASGI middleware: a Control API request without the token (header HEADER) is answered 403 here; every other
    request goes on to Flower unchanged. The token is compared in constant time."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token.encode()

    async def __call__(self, scope, receive, send):
        if scope.get("type") in ("http", "websocket") and is_control_path(scope.get("path", "")):
            given = dict(scope.get("headers") or []).get(HEADER.encode(), b"")
            if not hmac.compare_digest(given, self.token):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = (b"fedpipe: the SuperLink's Control API needs the operator's token (header "
                        + HEADER.encode() + b"); see docs/security.md, 'The Control API'\n")
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                                        (b"x-fedpipe-control", b"refused")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def guard_superlink(args: list[str]) -> None:
    """Flower's `flower-superlink` with `args`, the Control API guarded by the token in $FEDPIPE_CONTROL_TOKEN_FILE."""
    token = read_token(os.environ.pop(TOKEN_ENV, None))  # popped: the SuperExec and its ServerApps must not inherit it
    if os.environ.get("FLWR_INTERNAL_GRPC_CONTROL_API") == "1":
        # a second, gRPC Control API (flower_superlink.py:140) would bypass the guard
        raise ControlTokenError("FLWR_INTERNAL_GRPC_CONTROL_API=1 starts Flower's legacy gRPC Control API, which fedpipe's "
                                "token guard does not cover: unset it")
    from flwr.superlink import extensions
    from flwr.superlink.cli.flower_superlink import flower_superlink
    from starlette.middleware import Middleware

    theirs = extensions.get_middleware
    extensions.get_middleware = lambda: (Middleware(ControlTokenGuard, token=token), *theirs())  # outermost
    sys.argv = ["flower-superlink", *args]
    flower_superlink()


def flwr_cli(args: list[str]) -> None:
    """Flower's `flwr` CLI with `args`, each Control API request carrying the token in $FEDPIPE_CONTROL_TOKEN_FILE."""
    token = read_token(os.environ.get(TOKEN_ENV), private=False)
    from flwr.cli import cli_client_interceptor
    from flwr.cli.app import app

    interceptor = cli_client_interceptor.CliClientHttpInterceptor
    theirs = interceptor.intercept

    def intercept(self, context, call_next):
        context.request.headers[HEADER] = token
        return theirs(self, context, call_next)

    interceptor.intercept = intercept
    sys.argv = ["flwr", *args]
    app()


def cli_command(flwr: str | Path, environ: dict[str, str]) -> list[str]:
    """How to run the `flwr` program `flwr` (the Flower environment's bin/flwr): through `flwr_cli` with that
    environment's python when `environ` names a token file, else as it is."""
    if environ.get(TOKEN_ENV):
        return [str(Path(flwr).parent / "python"), "-m", "fedpipe.federation.control", "flwr"]
    return [str(flwr)]


def superlink_command(python: str | Path) -> list[str]:
    """The start of a guarded SuperLink's command (`python`: the Flower environment's); flower-superlink's args follow."""
    return [str(python), "-m", "fedpipe.federation.control", "superlink", "--"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("superlink", "flwr"):
        print("usage: python -m fedpipe.federation.control superlink -- <flower-superlink args>\n"
              "       python -m fedpipe.federation.control flwr <flwr args>\n"
              f"(the token file in ${TOKEN_ENV})", file=sys.stderr)
        return 2
    rest = argv[1:]
    try:
        if argv[0] == "superlink":
            guard_superlink(rest[1:] if rest[:1] == ["--"] else rest)
        else:
            flwr_cli(rest)
    except ControlTokenError as e:
        print(f"fedpipe: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
