"""`fedpipe site check` without a SuperLink: each thing that would stop a site from joining is named in one line
(the live handshake, right and wrong CA, is in test_own_files.py)."""

from __future__ import annotations

import shutil

import pytest
from own_data import SITES, write_digit_folders
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.data.files.init import init_manifest, write_manifest
from fedpipe.federation.certs import make_site_key, make_tls
from fedpipe.federation.tryout import free_port


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    work = tmp_path_factory.mktemp("site-check")
    pooled = write_digit_folders(work / "pooled")
    write_manifest(str(pooled), init_manifest(str(pooled))[0])
    files = work / "files"
    shutil.copytree(pooled / SITES[0], files / SITES[0])
    shutil.copy(pooled / "fedpipe-data.yaml", files / "fedpipe-data.yaml")
    key, _ = make_site_key(work / "key", SITES[0])
    return {"pooled": pooled, "files": files, "key": key, "ca": make_tls(work / "tls")["ca_cert"], "work": work}


def check(site, *, data=None, key=None, superlink=None):
    args = ["site", "check", "--data", str(data or site["files"]), "--key", str(key or site["key"]), "--root-certificates",
            str(site["ca"]), "--superlink", superlink or f"127.0.0.1:{free_port()}", "--timeout", "2"]
    return CliRunner().invoke(app, args)


def test_an_unreachable_superlink_is_named_after_the_data_and_key_pass(site):
    r = check(site)
    assert r.exit_code == 2 and f"site {SITES[0]}:" in r.stdout and "an OpenSSH private key" in r.stdout
    assert "cannot reach the SuperLink at 127.0.0.1:" in r.stderr and "NetworkPolicy" in r.stderr, r.stderr


def test_a_key_that_is_not_a_private_key_is_refused(site):
    public = site["key"].with_suffix(".pub")
    r = check(site, key=public)
    assert r.exit_code == 2 and "is not an unencrypted OpenSSH private key" in r.stderr, r.stderr


def test_a_folder_of_several_clients_is_not_one_site(site):
    r = check(site, data=site["pooled"])
    assert r.exit_code == 2 and f"holds {len(SITES)} clients" in r.stderr, r.stderr


def test_a_superlink_that_is_not_host_and_port(site):
    r = check(site, superlink="superlink.example.org")
    assert r.exit_code == 2 and "is not host:port" in r.stderr, r.stderr
