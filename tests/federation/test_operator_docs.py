"""docs/federation.md's "The operator's first federation, by hand", run as its operator and two hospital sites would
on one machine: each command as the page writes it (tests/test_docs_examples.py reads the section and checks its
commands are these), with the page's names, port and paths those of this machine, not through the try-out.

The operator works in one folder, with `examples/` and `.venv/` linked in as at the repository's root; each site works
in a folder of its own, with its own image folder (tests/own_data.py's digits, one subfolder named after the site).
The processes this test starts (the SuperLink, the two sites) are ended at the end, with their children."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_docs_examples import FEDPIPE, ROOT, _as_here, _operator_section, run


@pytest.fixture
def reader(tmp_path: Path) -> Path:
    """The operator's folder, laid out as the repository's root is, for the page's relative paths."""
    for name in ("examples", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _start(words: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(["nice", "-n", "10", str(FEDPIPE), *words[1:]], cwd=cwd, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, env=os.environ, start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    """End the processes this test started, with their children (the SuperLink's SuperExec runs in a session of its own)."""
    import signal

    from fedpipe.federation.tryout import descendants

    for p in procs[::-1]:
        family = [p.pid, *(pid for pid, _ in descendants(p.pid))]
        for pid in family[::-1]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            for pid in family:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)


def _wait_port(port: int, p: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.poll() is None, f"the SuperLink exited ({p.returncode}):\n{log.read_text()[-3000:]}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise AssertionError(f"the SuperLink did not listen on {port} within {timeout}s:\n{log.read_text()[-3000:]}")


@pytest.mark.federation
@pytest.mark.xdist_group("federation")
@pytest.mark.slow
@pytest.mark.timeout(600)  # about a minute and a half on 2 cores
def test_the_operators_first_federation_runs_as_the_docs_say(reader: Path, flower_env, monkeypatch):
    """docs/federation.md's operator section, by hand: certificates, the SuperLink (`fedpipe federation superlink`), two
    sites' keys, registrations and joins on their own image folders, and the 3-round FedAvg run of
    examples/fedavg_own_images_federation.yaml: each command as the page writes it, its names, port and paths this
    machine's. The operator works in `reader`, each site in a folder of its own; a site sends NAME.pub and gets ca.crt."""
    from own_data import SITES, write_digit_folders

    from fedpipe.federation.tryout import free_port

    monkeypatch.setenv("FEDPIPE_FLOWER_ENV", str(flower_env))  # step 1: how every command finds the Flower environment
    (certs, superlink, same_as, token, keygen, register, join, run_) = _operator_section()
    port = free_port()
    pooled = write_digit_folders(reader / "pooled", limit=300)  # every label: the federation's one manifest is made from it
    run(["fedpipe", "data", "init", str(pooled)], reader, [])  # step 4's `fedpipe data init`
    run(_as_here(certs, port), reader, [])
    procs: list[subprocess.Popen] = []
    logs = reader / "logs"
    logs.mkdir()
    try:
        procs.append(_start(_as_here(superlink, port), reader, logs / "superlink.log"))
        _wait_port(port, procs[0], logs / "superlink.log")
        # the page's spelled-out command is what runs, with the Flower environment's bin first on PATH
        cmdline = (Path("/proc") / str(procs[0].pid) / "cmdline").read_bytes().decode().split("\0")[:-1]
        written = _as_here(same_as, port)[4:]  # after its four environment variables
        assert Path(cmdline[0]) == flower_env / "bin" / "python" and written[0] == "python", cmdline
        assert cmdline[1:] == [str((reader / w).resolve()) if w.startswith("certs/") else w for w in written[1:]], cmdline
        environ = dict(e.split("=", 1) for e in (Path("/proc") / str(procs[0].pid) / "environ").read_bytes().decode().split("\0") if "=" in e)
        assert environ["PATH"].startswith(f"{flower_env / 'bin'}:") and environ["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.1"
        for assignment in same_as[2:4]:  # FEDPIPE_CONTROL_TOKEN_FILE and FEDPIPE_SERVER_STORE, as the page spells them
            name, value = assignment.split("=", 1)
            assert environ[name] == value.replace("$PWD", str(reader.resolve())), (name, environ.get(name))
        # the operator's shell, for steps 5 and 7: the SuperLink's Control API token
        assert token[0] == "export" and token[1].startswith("FEDPIPE_CONTROL_TOKEN_FILE=")
        monkeypatch.setenv("FEDPIPE_CONTROL_TOKEN_FILE", token[1].split("=", 1)[1].replace("$PWD", str(reader)))
        for site in SITES[:2]:
            home = reader / site
            (home / "data").mkdir(parents=True)
            shutil.copytree(pooled / site, home / "data" / site)  # the site's folder: one subfolder named after it
            shutil.copy(pooled / "fedpipe-data.yaml", home / "data")  # the federation's manifest, the same at every site
            run(["fedpipe", "data", "check", str(home / "data")], home, [])  # step 4's `fedpipe data check`
            run(_as_here(keygen, port, site), home, [])
            shutil.copy(home / "keys" / f"{site}.pub", reader)  # the site sends its public key
            shutil.copy(reader / "certs" / "ca.crt", home)  # the operator gives it the CA certificate
            run(_as_here(register, port, site), reader, [])
            joined = _as_here(join, port, site, home / "data")
            procs.append(_start([*joined, "--port", str(free_port())], home, logs / f"{site}.log"))  # two sites, one machine
        run(_as_here(run_, port), reader, [])
        for site in SITES[:2]:
            assert "Traceback" not in (logs / f"{site}.log").read_text(), (logs / f"{site}.log").read_text()[-3000:]
    finally:
        _stop(procs)
    (summary,) = (reader / "runs").glob("*/report/summary.json")
    result = json.loads(summary.read_text())
    assert result["rounds"] == 3 and sorted(result["per_site"]) == list(SITES[:2]) and result["sites"] == 2, result
    assert result["mode"] == "federation" and "fedavg" in result["title"].lower(), result
    assert sorted(json.loads((reader / "federation-sites.json").read_text())["sites"]) == list(SITES[:2])  # the ledger
