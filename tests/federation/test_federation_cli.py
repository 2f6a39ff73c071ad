"""`fedpipe federation`: the operator's certificates, and site keys registered, rotated and listed.

Without Flower: the CA and server certificate (modes, the chain, the names, renewal under the same CA, the Kubernetes
Secret manifests, no key material printed), the refusals, and rotation's two failure rules against a stand-in `flwr`
that answers as Flower 1.42's does (`--format json`, exit status 0 with "success": false on a refusal).
Live: a real SuperLink (TLS from `fedpipe federation certs`, SuperNode authentication on) on 127.0.0.1: two sites
registered and listed, one rotated, its old node gone and its old key refused at activation."""

from __future__ import annotations

import base64
import json
import re
import stat
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from typer.testing import CliRunner

import fedpipe.cli.federation as federation_cli
from fedpipe.cli import app
from fedpipe.federation.certs import make_site_key
from fedpipe.federation.tryout import free_port, superlink_args


def fed(*args: str):
    return CliRunner().invoke(app, ["federation", *map(str, args)])


def key_texts(*paths: Path) -> list[str]:
    """What would betray a private key in the output: its PEM body lines, and the base64 of its file (as in a Secret)."""
    texts = []
    for path in paths:
        pem = path.read_text()
        texts += [line for line in pem.splitlines() if line and not line.startswith("-----")]
        texts.append(base64.b64encode(pem.encode()).decode()[:64])
    return texts


# --- certificates ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs") / "ca"
    r = fed("certs", "--out", out, "--host", "fl.example.org", "--host", "203.0.113.7", "--kubernetes-secret", "superlink-tls")
    assert r.exit_code == 0, r.stdout + r.stderr
    return out, r


def test_certs_are_private_and_the_server_certificate_chains_to_the_ca_with_the_hosts(made):
    out, _ = made
    for name in ("ca.key", "server.key", "superlink-tls.secret.yaml"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["203.0.113.7", "127.0.0.1"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_the_secret_manifests_are_what_the_charts_read(made):
    out, _ = made
    server = yaml.safe_load((out / "superlink-tls.secret.yaml").read_text())
    assert (server["kind"], server["type"], server["metadata"]["name"]) == ("Secret", "kubernetes.io/tls", "superlink-tls")
    files = {"tls.crt": "server.crt", "tls.key": "server.key", "ca.crt": "ca.crt"}  # the main chart's federation.tls.secretName
    assert set(server["data"]) == set(files)
    for field, name in files.items():
        assert base64.b64decode(server["data"][field]) == (out / name).read_bytes(), field
    sites = yaml.safe_load((out / "ca.secret.yaml").read_text())  # the fedpipe-site chart's superlink.caSecret (key ca.crt)
    site_values = yaml.safe_load((Path(__file__).parents[2] / "charts/fedpipe-site/values.yaml").read_text())
    assert sites["metadata"]["name"] == "federation-ca" and sites["type"] == "Opaque"
    assert list(sites["data"]) == [site_values["superlink"]["caSecret"]["key"]]
    assert base64.b64decode(sites["data"]["ca.crt"]) == (out / "ca.crt").read_bytes()


def test_no_key_material_is_printed(made):
    out, r = made
    printed = r.stdout + r.stderr
    assert "sha256 " in printed and str(out / "server.key") in printed
    for text in key_texts(out / "ca.key", out / "server.key"):
        assert text not in printed


def test_an_existing_ca_is_not_overwritten(made):
    out, _ = made
    before = {n: (out / n).read_bytes() for n in ("ca.crt", "ca.key", "server.crt", "server.key")}
    r = fed("certs", "--out", out, "--host", "fl.example.org")
    assert r.exit_code == 2 and "already holds ca.crt, ca.key" in r.stderr and "--renew-server" in r.stderr, r.stderr
    assert {n: (out / n).read_bytes() for n in before} == before


def test_renew_server_keeps_the_ca(tmp_path):
    out = tmp_path / "ca"
    assert fed("certs", "--out", out, "--host", "fl.example.org").exit_code == 0
    ca_before, key_before, server_before = ((out / n).read_bytes() for n in ("ca.crt", "ca.key", "server.crt"))
    r = fed("certs", "--out", out, "--host", "fl.example.org", "--host", "fl2.example.org", "--renew-server")
    assert r.exit_code == 0 and "(kept;" in r.stdout, r.stdout + r.stderr
    assert (out / "ca.crt").read_bytes() == ca_before and (out / "ca.key").read_bytes() == key_before
    assert (out / "server.crt").read_bytes() != server_before
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_before))
    assert "fl2.example.org" in server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    r = fed("certs", "--out", tmp_path / "empty", "--host", "fl.example.org", "--renew-server")
    assert r.exit_code == 2 and "does not exist" in r.stderr, r.stderr


def test_a_host_that_is_not_a_name(tmp_path):
    r = fed("certs", "--out", tmp_path / "ca", "--host", "https://fl.example.org:9092")
    assert r.exit_code == 2 and "neither an IP address nor a DNS name" in r.stderr and not (tmp_path / "ca").exists(), r.stderr


def test_renewal_replaces_a_link_at_its_temporary_file_without_following_it(tmp_path):
    """--renew-server writes server.key through `.server.key.tmp`: a link planted there must not carry the new private
    key (nor a chmod) into the file it points at."""
    out = tmp_path / "ca"
    assert fed("certs", "--out", out, "--host", "fl.example.org").exit_code == 0
    target = tmp_path / "elsewhere.txt"
    target.write_text("not yours")
    (out / ".server.key.tmp").symlink_to(target)
    r = fed("certs", "--out", out, "--host", "fl.example.org", "--renew-server")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert target.read_text() == "not yours" and not (out / "server.key").is_symlink()
    assert stat.S_IMODE((out / "server.key").stat().st_mode) == 0o600 and b"PRIVATE KEY" in (out / "server.key").read_bytes()


def test_a_dangling_link_at_the_ca_key_is_not_written_through(tmp_path):
    out = tmp_path / "ca"
    out.mkdir()
    target = tmp_path / "elsewhere.key"
    (out / "ca.key").symlink_to(target)  # Path.exists() says False for it: only the exclusive open catches it
    r = fed("certs", "--out", out, "--host", "fl.example.org")
    assert r.exit_code == 2 and "ca.key already exists" in r.stderr, r.stdout + r.stderr
    assert not target.exists()


def site(*args: str):
    return CliRunner().invoke(app, ["site", *map(str, args)])


def test_keygen_never_overwrites_a_site_key(tmp_path):
    """The key may already be registered with the SuperLink: a second keygen under the same name refuses and keeps it."""
    assert site("keygen", "hospital-a", "--out", tmp_path).exit_code == 0
    before = {n: (tmp_path / n).read_bytes() for n in ("hospital-a.key", "hospital-a.pub")}
    assert stat.S_IMODE((tmp_path / "hospital-a.key").stat().st_mode) == 0o600
    r = site("keygen", "hospital-a", "--out", tmp_path)
    assert r.exit_code == 2 and "hospital-a.key already exists" in r.stderr and "fedpipe federation rotate" in r.stderr, r.stderr
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    (tmp_path / "hospital-a.key").unlink()  # the public key alone is enough to refuse
    assert site("keygen", "hospital-a", "--out", tmp_path).exit_code == 2
    assert (tmp_path / "hospital-a.pub").read_bytes() == before["hospital-a.pub"]


@pytest.mark.parametrize("planted", ["hospital-a.key", "hospital-a.pub"])
def test_keygen_does_not_follow_a_link_at_the_key_path(tmp_path, planted):
    keys, target = tmp_path / "keys", tmp_path / "precious.txt"
    keys.mkdir()
    target.write_text("precious")
    target.chmod(0o644)
    (keys / planted).symlink_to(target)
    r = site("keygen", "hospital-a", "--out", keys)
    assert r.exit_code == 2 and f"{planted} already exists" in r.stderr, r.stdout + r.stderr
    assert target.read_text() == "precious" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not (keys / ("hospital-a.pub" if planted.endswith(".key") else "hospital-a.key")).exists()


# --- the SuperLink -----------------------------------------------------------------------------------------------


def test_the_superlink_command_starts_flower_superlink_with_tls_auth_and_the_flower_bin_on_path(tmp_path, monkeypatch):
    env = tmp_path / "flower"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "flower-superlink").write_text("#!/bin/sh\n")
    (env / "bin" / "python").write_text("#!/bin/sh\n")
    certs = tmp_path / "certs"
    assert fed("certs", "--out", certs, "--host", "fl.example.org").exit_code == 0
    started = []
    monkeypatch.setattr(federation_cli.os, "execve", lambda program, args, environ: started.append((program, args, environ)))
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "3")
    monkeypatch.setenv("FEDPIPE_SERVER_ROOT", "/")  # not passed on: this SuperLink's ServerApps serve store runs only
    r = fed("superlink", "--certs", certs, "--host", "0.0.0.0", "--port", "9093", "--flower-env", env, "--store", "s3://runs/fedpipe",
            "--store", str(tmp_path / "shared"))
    assert r.exit_code == 0, r.stdout + r.stderr
    [(program, args, environ)] = started
    # Flower's flower-superlink behind fedpipe's Control API token check (fedpipe.federation.control)
    assert program == str(env / "bin" / "python") and args[:5] == [program, "-m", "fedpipe.federation.control", "superlink", "--"]
    token = certs / "control.token"
    assert environ["FEDPIPE_CONTROL_TOKEN_FILE"] == str(token.resolve()) and token.stat().st_mode & 0o777 == 0o600
    assert len(token.read_text().strip()) >= 32
    assert environ["FEDPIPE_SERVER_STORE"] == f"s3://runs/fedpipe,{tmp_path / 'shared'}" and "FEDPIPE_SERVER_ROOT" not in environ
    assert args[5:] == ["--ssl-ca-certfile", str(certs.resolve() / "ca.crt"), "--ssl-certfile", str(certs.resolve() / "server.crt"),
                        "--ssl-keyfile", str(certs.resolve() / "server.key"), "--enable-supernode-auth", "--host", "0.0.0.0",
                        "--port", "9093", "--disable-runtime-dependency-installation"]
    assert environ["PATH"].split(":")[:2] == [str(env / "bin"), "/usr/bin"]  # it starts flower-superexec by name
    assert environ["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.1"
    assert "SuperLink on 0.0.0.0:9093" in r.stdout and "only registered site keys join" in r.stdout
    monkeypatch.setenv("FEDPIPE_FLOWER_ENV", str(env))  # found as `fedpipe site join` finds it
    monkeypatch.setattr("fedpipe.cli.site.FLOWER_ENV", env)
    assert fed("superlink", "--certs", certs).exit_code == 0 and started[-1][0] == str(env / "bin" / "python")
    assert "FEDPIPE_SERVER_STORE" not in started[-1][2] and token.read_text() == open(started[-1][2]["FEDPIPE_CONTROL_TOKEN_FILE"]).read()
    assert started[-1][1][-5:] == ["--host", "0.0.0.0", "--port", "9093", "--disable-runtime-dependency-installation"]


def test_the_superlink_command_names_missing_certificates_and_a_missing_flower(tmp_path, monkeypatch):
    monkeypatch.setattr(federation_cli.os, "execve", lambda *a: pytest.fail("started without its files"))
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.crt").write_text("x")
    r = fed("superlink", "--certs", tmp_path / "certs", "--flower-env", tmp_path)
    assert r.exit_code == 2 and "has no server.crt, server.key" in r.stderr and "fedpipe federation certs --out" in r.stderr, r.stderr
    assert fed("certs", "--out", tmp_path / "made", "--host", "localhost").exit_code == 0
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    r = fed("superlink", "--certs", tmp_path / "made", "--flower-env", tmp_path / "no-flower")
    assert r.exit_code == 2 and "flower-superlink (Flower 1.42) was not found" in r.stderr and "scripts/flower-env.sh" in r.stderr, r.stderr


# --- register, rotate, sites without Flower ----------------------------------------------------------------------

FAKE_FLWR = """#!{python}
# A stand-in for Flower 1.42's `flwr supernode register|unregister|ls CONNECTION --format json`: its JSON, its exit
# status 0 with "success": false on a refusal; STATE (a JSON file) holds the nodes, the calls made and what to refuse.
import json, os, sys
path = os.environ["FAKE_FLWR_STATE"]
state = json.load(open(path))
command = sys.argv[2]
state["calls"].append(command)
banner = "Using SuperLink: c (127.0.0.1:1)\\n\\n"
if command in state["refuse"]:
    answer = {{"success": False, "error-message": banner + "[code: 99] " + state["refuse"][command]}}
elif command == "register":
    node = 1000 + len(state["nodes"])
    state["nodes"][str(node)] = "registered"
    answer = {{"success": True, "node-id": node}}
elif command == "unregister":
    state["nodes"][sys.argv[3]] = "unregistered"
    answer = {{"success": True, "node-id": int(sys.argv[3])}}
else:
    answer = {{"success": True, "nodes": [{{"node-id": n, "status": s, "created-at": "2026-11-28 10:00:00Z", "online-at": "N/A",
                                           "offline-at": "N/A", "deleted-at": "N/A"}} for n, s in state["nodes"].items()]}}
json.dump(state, open(path, "w"))
print(json.dumps(answer, indent=2))
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A Flower environment whose `flwr` is the stand-in, a SuperLink whose TLS check passes, two site keys."""
    env = tmp_path / "flower"
    (env / "bin").mkdir(parents=True)
    flwr = env / "bin" / "flwr"
    flwr.write_text(FAKE_FLWR.format(python=sys.executable))
    flwr.chmod(0o755)
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"nodes": {}, "calls": [], "refuse": {}}))
    monkeypatch.setenv("FAKE_FLWR_STATE", str(state))
    monkeypatch.setattr(federation_cli, "_check_superlink", lambda *a: "127.0.0.1")
    (tmp_path / "ca.crt").write_text("stand-in")
    keys = {n: make_site_key(tmp_path / "keys", n) for n in ("hospital-a", "hospital-a-new", "hospital-b")}
    common = ["--superlink", "127.0.0.1:1", "--root-certificates", tmp_path / "ca.crt", "--ledger", tmp_path / "sites.json",
              "--flower-env", env]

    def flower_state(**refuse):
        data = json.loads(state.read_text())
        if refuse:
            data["refuse"] = refuse
            state.write_text(json.dumps(data))
        return data

    return {"keys": keys, "common": common, "state": flower_state, "ledger": tmp_path / "sites.json", "tmp": tmp_path}


def test_a_private_key_given_to_register_is_refused(stand_in):
    private, _ = stand_in["keys"]["hospital-a"]
    r = fed("register", private, *stand_in["common"])
    assert r.exit_code == 2 and "is a PRIVATE key" in r.stderr and "send only its public key, the .pub" in r.stderr, r.stderr
    for text in key_texts(private):
        assert text not in r.stdout + r.stderr
    assert stand_in["state"]()["calls"] == [] and not stand_in["ledger"].exists()


def test_register_records_the_node_and_refuses_a_second_registration(stand_in):
    _, public = stand_in["keys"]["hospital-a"]
    r = fed("register", public, *stand_in["common"])
    assert r.exit_code == 0, r.stderr
    entry = json.loads(stand_in["ledger"].read_text())["sites"]["hospital-a"]
    assert entry["node_id"] == 1000 and entry["fingerprint"].startswith("SHA256:")
    assert "registered as node 1000" in r.stdout and entry["fingerprint"] in r.stdout
    assert public.read_text().split()[1] not in r.stdout + r.stderr  # the fingerprint, never the key itself
    r = fed("register", public, *stand_in["common"])
    assert r.exit_code == 2 and "already registered as node 1000" in r.stderr and "federation rotate" in r.stderr, r.stderr


def test_a_failed_new_registration_unregisters_nothing(stand_in):
    assert fed("register", stand_in["keys"]["hospital-a"][1], *stand_in["common"]).exit_code == 0
    before = stand_in["ledger"].read_text()
    stand_in["state"](register="Public key already in use.")
    r = fed("rotate", "hospital-a", stand_in["keys"]["hospital-a-new"][1], *stand_in["common"])
    assert r.exit_code == 2 and "Flower refused to register the key of site hospital-a" in r.stderr, r.stderr
    assert "Public key already in use. (Flower error code 99)" in r.stderr and "Using SuperLink" not in r.stderr
    assert "unregister" not in stand_in["state"]()["calls"] and stand_in["ledger"].read_text() == before


def test_a_failed_unregistration_keeps_the_new_key_and_says_how_to_finish(stand_in):
    assert fed("register", stand_in["keys"]["hospital-a"][1], *stand_in["common"]).exit_code == 0
    stand_in["state"](unregister="Connection reset.")
    new = stand_in["keys"]["hospital-a-new"][1]
    r = fed("rotate", "hospital-a", new, *stand_in["common"])
    assert r.exit_code == 2 and "IS registered (node 1001" in r.stderr and "old node 1000 can still activate" in r.stderr, r.stderr
    assert f"run again: fedpipe federation rotate hospital-a {new} --superlink 127.0.0.1:1" in " ".join(r.stderr.split())
    entry = json.loads(stand_in["ledger"].read_text())["sites"]["hospital-a"]
    assert entry["node_id"] == 1001 and entry["retired"][0]["node_id"] == 1000 and not entry["retired"][0].get("unregistered_at")
    stand_in["state"](nothing="")  # Flower answers again: the same command finishes the rotation
    r = fed("rotate", "hospital-a", new, *stand_in["common"])
    assert r.exit_code == 0 and "old node 1000" in r.stdout and "unregistered" in r.stdout, r.stderr
    assert stand_in["state"]()["calls"] == ["register", "register", "unregister", "unregister"]  # no third registration
    assert json.loads(stand_in["ledger"].read_text())["sites"]["hospital-a"]["retired"][0]["unregistered_at"]


def test_sites_names_the_ledgers_sites(stand_in):
    for name in ("hospital-a", "hospital-b"):
        assert fed("register", stand_in["keys"][name][1], *stand_in["common"]).exit_code == 0
    r = fed("sites", *stand_in["common"])
    assert r.exit_code == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    assert rows[0] == ["NODE", "ID", "STATUS", "SITE", "SINCE"]
    assert [row[:3] for row in rows[1:]] == [["1000", "registered", "hospital-a"], ["1001", "registered", "hospital-b"]]


def test_flower_missing_and_superlink_unreachable_are_named(stand_in, monkeypatch):
    _, public = stand_in["keys"]["hospital-a"]
    common = stand_in["common"][:-1] + [stand_in["tmp"] / "no-flower"]
    monkeypatch.setenv("PATH", str(stand_in["tmp"] / "empty"))
    r = fed("register", public, *common)
    assert r.exit_code == 2 and "flwr (Flower 1.42) was not found" in r.stderr and "scripts/flower-env.sh" in r.stderr, r.stderr
    monkeypatch.undo()  # the real TLS check again, against a port where nothing listens
    ca = stand_in["tmp"] / "tls"
    assert fed("certs", "--out", ca, "--host", "127.0.0.1").exit_code == 0
    port = free_port()
    common = ["--superlink", f"127.0.0.1:{port}", "--root-certificates", ca / "ca.crt", "--ledger", stand_in["ledger"],
              "--flower-env", stand_in["common"][-1], "--timeout", "2"]
    r = fed("register", public, *common)
    assert r.exit_code == 2 and f"the TLS check of the SuperLink at 127.0.0.1:{port} failed" in r.stderr, r.stderr
    assert "cannot reach the SuperLink" in r.stderr and not stand_in["ledger"].exists()


# --- live: a real SuperLink --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def superlink(request, tmp_path_factory):
    """A real flower-superlink on 127.0.0.1 with TLS from `fedpipe federation certs` and SuperNode authentication,
    started as tryout.py starts it; stopped at the end of the module."""
    try:
        env = request.getfixturevalue("flower_env")  # conftest: scripts/flower-env.sh builds or reuses it
    except pytest.fail.Exception as e:
        pytest.skip(f"the Flower environment (scripts/flower-env.sh) is missing and could not be built: {str(e)[:300]}")
    from fedpipe.federation.tryout import LoopbackFederation

    work = tmp_path_factory.mktemp("federation-cli")
    assert fed("certs", "--out", work / "certs", "--host", "localhost").exit_code == 0
    link = LoopbackFederation(work, env)
    link.tls = {"ca_cert": work / "certs" / "ca.crt"}
    link._spawn("superlink", superlink_args(link.bin / "flower-superlink", work / "certs" / "ca.crt", work / "certs" / "server.crt",
                                            work / "certs" / "server.key", "127.0.0.1", link.port))
    try:
        link._wait_port(link.port, "superlink")
        yield {"link": link, "work": work, "env": env, "superlink": f"127.0.0.1:{link.port}", "ca": work / "certs" / "ca.crt",
               "common": ["--superlink", f"127.0.0.1:{link.port}", "--root-certificates", work / "certs" / "ca.crt",
                          "--ledger", work / "sites.json", "--flower-env", env]}
    finally:
        link.stop()


def flwr_nodes(live) -> dict[str, str]:
    """{node id: status} as `flwr supernode ls --format json` gives them (Flower's own view, not the command's table)."""
    with federation_cli.flower(live["env"], live["superlink"], live["ca"], 20) as fl:
        return {n["node-id"]: n["status"] for n in fl.call("list the nodes", "supernode", "ls")["nodes"]}


@pytest.mark.federation
@pytest.mark.xdist_group("federation")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_register_list_rotate_against_a_real_superlink(superlink):
    live, work = superlink, superlink["work"]
    keys = {n: make_site_key(work / "keys", n) for n in ("hospital-a", "hospital-b", "hospital-a-2")}
    for name in ("hospital-a", "hospital-b"):
        r = fed("register", keys[name][1], *live["common"])
        assert r.exit_code == 0, r.stdout + r.stderr
    ledger = json.loads((work / "sites.json").read_text())["sites"]
    old, other = str(ledger["hospital-a"]["node_id"]), str(ledger["hospital-b"]["node_id"])
    r = fed("sites", *live["common"])
    assert r.exit_code == 0, r.stderr
    listed = {row.split()[0]: row.split()[1:3] for row in r.stdout.splitlines()[1:]}
    assert listed == {old: ["registered", "hospital-a"], other: ["registered", "hospital-b"]}, r.stdout

    r = fed("rotate", "hospital-a", keys["hospital-a-2"][1], *live["common"])
    assert r.exit_code == 0, r.stdout + r.stderr
    new = str(json.loads((work / "sites.json").read_text())["sites"]["hospital-a"]["node_id"])
    nodes = flwr_nodes(live)
    assert nodes.get(new) == "registered" and nodes.get(other) == "registered"
    assert nodes.get(old, "unregistered") == "unregistered", nodes  # Flower 1.42's JSON lists it as unregistered

    # the old key no longer activates: Flower's SuperNode is refused (as an unregistered site's, test_loopback.py)
    from fedpipe.federation.tryout import supernode_options

    (work / "old-site").mkdir()
    args = [str(live["link"].bin / "flower-supernode"), *supernode_options(live["superlink"], work / "certs" / "ca.crt",
                                                                          keys["hospital-a"][0], {"site-dir": str(work / "old-site")}, free_port())]
    proc = live["link"]._spawn("old-key", args)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "Failed to activate SuperNode" not in live["link"].log_of("old-key") and proc.poll() is None:
        time.sleep(0.3)
    log = live["link"].log_of("old-key")
    live["link"].stop("old-key")
    assert "Failed to activate SuperNode" in log, log[-3000:]
    assert not re.search(r"SuperNode ID: ?" + old, log)
