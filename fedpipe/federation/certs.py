"""A try-out CA, the SuperLink's TLS certificate and the sites' authentication keys.

TLS: the SuperLink serves its HTTPS API (Fleet, Control and Runtime on one port in Flower 1.42,
flwr/superlink/cli/flower_superlink.py `_run_superlink_http_api`) with `--ssl-certfile/--ssl-keyfile`;
SuperNodes, SuperExec and the `flwr` CLI verify it against the CA (`--root-certificates`, and
`root-certificates` of the SuperLink connection in $FLWR_HOME/config.toml).

Site keys: SuperNode authentication takes an EC key on a NIST curve in OpenSSH format: the private key
for `flower-supernode --auth-supernode-private-key` (flwr/supernode/cli/flower_supernode.py) and the
public key for `flwr supernode register` (flwr/cli/supernode/register.py, `try_load_public_key`).
`make_tls` is for a try-out (a fresh CA each call). A federation's operator uses `make_federation_tls`
(`fedpipe federation certs`): a CA made once and kept (its key offline), a server certificate that can be renewed
under the same CA so that sites keep their trust, and Kubernetes Secret manifests for the charts; each site makes
its own key pair (`fedpipe site keygen`) and sends only its public key (`load_site_public_key` checks one).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedpipe.errors import ConfigError
from fedpipe.safe_load import read_file


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    """`data` into a NEW file `path`: never over a file already there nor through a link planted at its name (O_EXCL,
    O_NOFOLLOW); a private file is created with mode 600 (never readable by others, not even for a moment)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600 if private else 0o666)  # 666 less the umask, as write_bytes makes it
    except FileExistsError:
        raise ConfigError(f"{path} already exists (a file or a link): fedpipe writes its keys and certificates only as new "
                          "files, never over one nor through a link; move it away, or give another folder") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _replace(path: Path, data: bytes, private: bool = False) -> Path:
    """`data` into `path` atomically (a new temporary file beside it, then renamed): a reader sees the old or the new file,
    and a link at `path` is replaced, not followed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # left by a crash, or planted: removing a link leaves its target alone
    _write(tmp, data, private)
    os.replace(tmp, path)
    return path


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _ca_certificate(ca_key, common_name: str, days: int, now: dt.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(ca_key, hashes.SHA384()))


def _alt_name(host: str) -> x509.GeneralName:
    """An IP address SAN for an IP (v4 or v6), else a DNS name SAN."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def _server_certificate(ca: x509.Certificate, ca_key, key, hosts: tuple[str, ...], not_after: dt.datetime,
                        now: dt.datetime) -> x509.Certificate:
    return (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA384()))


def make_tls(folder: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 30) -> dict[str, Path]:
    """ca.crt (+ ca.key), server.crt and server.key for `hosts`, in `folder` (a try-out: a fresh CA every call)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = _ca_certificate(ca_key, "fedpipe try-out CA", days, now)
    key = ec.generate_private_key(ec.SECP384R1())
    cert = _server_certificate(ca, ca_key, key, tuple(hosts), now + dt.timedelta(days=days), now)
    # A try-out replaces its previous try-out's files (a fresh CA every call).
    return {
        "ca_cert": _replace(folder / "ca.crt", ca.public_bytes(serialization.Encoding.PEM)),
        "ca_key": _replace(folder / "ca.key", _key_pem(ca_key), private=True),
        "server_cert": _replace(folder / "server.crt", cert.public_bytes(serialization.Encoding.PEM)),
        "server_key": _replace(folder / "server.key", _key_pem(key), private=True),
    }


def make_site_key(folder: str | Path, name: str) -> tuple[Path, Path]:
    """<name>.key (OpenSSH private) and <name>.pub (OpenSSH public), P-384, both new: a ConfigError when either is
    there (or a link in its place), since that key may be registered with the SuperLink already."""
    folder = Path(folder)
    for path in (folder / f"{name}.key", folder / f"{name}.pub"):
        if os.path.lexists(path):
            raise ConfigError(f"{path} already exists: keygen never overwrites a site key, which may be registered with the "
                              "SuperLink. Keep using that key pair; to replace it, make a new one under another name (or "
                              "after moving the old files away) and have the operator run `fedpipe federation rotate "
                              "SITE NEW.pub`")
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return _write(folder / f"{name}.key", private, private=True), _write(folder / f"{name}.pub", public + b"\n")


# --- a federation's CA and SuperLink certificate (fedpipe federation certs) ------------------------------------

FEDERATION_CA_NAME = "fedpipe federation CA"
#: Always among the SuperLink certificate's names: its SuperExec calls the SuperLink's runtime API on its own loopback
LOOPBACK = "127.0.0.1"
_DNS_NAME = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
_SECRET_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_MAX_PEM_BYTES = 64 * 1024


@dataclass(frozen=True)
class FederationTLS:
    """The files `make_federation_tls` wrote or kept, and the two certificates (to print their fingerprints and dates)."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    ca: x509.Certificate
    server: x509.Certificate
    hosts: tuple[str, ...]
    renewed: bool  # True: the CA was kept and only the server certificate is new


def federation_hosts(hosts: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The SuperLink certificate's names: `hosts` in their order, without repeats, with 127.0.0.1 added; a ConfigError
    naming a host that is neither an IP address nor a DNS name."""
    out: list[str] = []
    for host in [*hosts, LOOPBACK]:
        host = host.strip()
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if not _DNS_NAME.fullmatch(host) or host.replace(".", "").isdigit():
                raise ConfigError(f"--host {host!r} is neither an IP address nor a DNS name (letters, digits, '-' and '.', "
                                  "e.g. fl.example.org or 203.0.113.7); give the names the sites and the operator dial, "
                                  "without a port or a scheme") from None
        if host and host not in out:
            out.append(host)
    return tuple(out)


def _read_bounded(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    return read_file(path, _MAX_PEM_BYTES, what).encode()


def _load_ca(folder: Path) -> tuple[x509.Certificate, object]:
    """The CA certificate and key kept in `folder`, checked to belong together and to be valid now."""
    try:
        ca = x509.load_pem_x509_certificate(_read_bounded(folder / "ca.crt", "the CA certificate"))
        ca_key = serialization.load_pem_private_key(_read_bounded(folder / "ca.key", "the CA key"), password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"the CA in {folder} (ca.crt, ca.key) cannot be read ({e}): renew only with the CA that "
                          "`fedpipe federation certs` made there") from None
    if ca.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            ca_key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        raise ConfigError(f"{folder}/ca.key is not the key of {folder}/ca.crt: put the CA's own key back beside it")
    if ca.not_valid_after_utc <= dt.datetime.now(dt.UTC):
        raise ConfigError(f"the CA in {folder} expired on {ca.not_valid_after_utc:%Y-%m-%d}: a new federation CA is needed "
                          "(a new --out folder), and every site must be given its ca.crt")
    return ca, ca_key


def make_federation_tls(folder: str | Path, hosts: list[str] | tuple[str, ...], days: int = 365, ca_days: int = 3650,
                        renew_server: bool = False) -> FederationTLS:
    """A federation's CA (ca.crt, ca.key) and the SuperLink's certificate (server.crt, server.key) for `hosts` (plus
    127.0.0.1), keys at mode 600. An existing CA is never overwritten: with `renew_server` it is kept and only a new
    server certificate and key are issued, signed by it (sites keep trusting the SuperLink), lasting `days` but never
    past the CA."""
    folder = Path(folder)
    names = federation_hosts(hosts)
    paths = {n: folder / n for n in ("ca.crt", "ca.key", "server.crt", "server.key")}
    now = dt.datetime.now(dt.UTC)
    if renew_server:
        if not paths["ca.key"].exists():
            raise ConfigError(f"--renew-server keeps the CA in {folder}, but {paths['ca.key']} does not exist: renew in the "
                              "folder the CA was made in, or leave out --renew-server to make a new CA")
        ca, ca_key = _load_ca(folder)
    else:
        there = [n for n, p in paths.items() if p.exists()]
        if there:
            raise ConfigError(f"{folder} already holds {', '.join(there)}: a new CA would cut off every site that trusts the "
                              "present one. Add --renew-server for a new SuperLink certificate signed by the same CA, or give "
                              "another --out for a new federation")
        folder.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP384R1())
        ca = _ca_certificate(ca_key, FEDERATION_CA_NAME, ca_days, now)
        _write(paths["ca.key"], _key_pem(ca_key), private=True)
        _write(paths["ca.crt"], ca.public_bytes(serialization.Encoding.PEM))
    key = ec.generate_private_key(ec.SECP384R1())
    server = _server_certificate(ca, ca_key, key, names, min(now + dt.timedelta(days=days), ca.not_valid_after_utc), now)
    _replace(paths["server.key"], _key_pem(key), private=True)
    _replace(paths["server.crt"], server.public_bytes(serialization.Encoding.PEM))
    return FederationTLS(paths["ca.crt"], paths["ca.key"], paths["server.crt"], paths["server.key"], ca, server, names,
                         renew_server)


def check_secret_name(name: str, what: str) -> str:
    if not _SECRET_NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not a Kubernetes object name: lower-case letters, digits, '-' and '.', "
                          "starting and ending with a letter or digit (e.g. superlink-tls)")
    return name


def _secret(name: str, kind: str, data: dict[str, bytes], comment: str) -> str:
    import yaml

    doc = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": kind,
           "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
    return comment + yaml.safe_dump(doc, sort_keys=False, width=1 << 20)


def write_secret_manifests(tls: FederationTLS, folder: Path, tls_secret: str, ca_secret: str = "federation-ca") -> tuple[Path, Path]:
    """`folder/<tls_secret>.secret.yaml`, a kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt) for the SuperLink (the
    main chart's `federation.tls.secretName`), mode 600; and `folder/ca.secret.yaml`, a Secret `ca_secret` holding only
    ca.crt, for sites (the fedpipe-site chart's `superlink.caSecret`, key ca.crt)."""
    check_secret_name(tls_secret, "--kubernetes-secret")
    check_secret_name(ca_secret, "--ca-secret")
    server = _secret(tls_secret, "kubernetes.io/tls",
                     {"tls.crt": tls.server_cert.read_bytes(), "tls.key": tls.server_key.read_bytes(), "ca.crt": tls.ca_cert.read_bytes()},
                     "# The SuperLink's TLS certificate, its PRIVATE KEY and the federation's CA (fedpipe federation certs).\n"
                     "# kubectl apply -n <namespace> -f this file; keep it as you keep server.key, or delete it once applied.\n")
    ca = _secret(ca_secret, "Opaque", {"ca.crt": tls.ca_cert.read_bytes()},
                 "# The federation's CA certificate only (no key): give it to each site, whose fedpipe-site chart names it\n"
                 "# as superlink.caSecret.name (key ca.crt).\n")
    return (_replace(folder / f"{tls_secret}.secret.yaml", server.encode(), private=True),
            _replace(folder / "ca.secret.yaml", ca.encode()))


# --- fingerprints and a site's public key ----------------------------------------------------------------------


def cert_fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate, as `openssl x509 -noout -fingerprint -sha256` prints it (AB:CD:...)."""
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def ssh_fingerprint(public_key) -> str:
    """SHA-256 of an OpenSSH public key, as `ssh-keygen -lf KEY.pub` prints it (SHA256:base64, unpadded)."""
    blob = base64.b64decode(public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


_NIST_CURVES = ("secp256r1", "secp384r1", "secp521r1")


def load_site_public_key(path: str | Path, limit: int = 16 * 1024):
    """A site's public key, checked to be what SuperNode authentication takes (an OpenSSH EC key on a NIST curve, as
    `fedpipe site keygen` writes NAME.pub); a ConfigError in plain words otherwise, never quoting the file's bytes."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: give the site's public key file (NAME.pub from `fedpipe site keygen`)")
    data = read_file(path, limit, "site public key (NAME.pub)").encode()
    if b"PRIVATE KEY" in data:
        raise ConfigError(f"{path} is a PRIVATE key: the site must send only its public key, the .pub file "
                          "(`fedpipe site keygen` writes NAME.pub beside NAME.key). A private key never leaves its site: "
                          "delete this copy here, and have the site make a new key pair if it was sent over an open channel")
    try:
        key = serialization.load_ssh_public_key(data.strip())
    except (ValueError, TypeError, UnsupportedAlgorithm):
        hint = " (it is PEM: Flower takes the OpenSSH format)" if b"-----BEGIN" in data else ""
        raise ConfigError(f"{path} is not an OpenSSH public key{hint}: give the NAME.pub that `fedpipe site keygen` wrote "
                          "(one line starting with ecdsa-sha2-nistp384)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in _NIST_CURVES:
        kind = key.curve.name if isinstance(key, ec.EllipticCurvePublicKey) else type(key).__name__.lstrip("_")
        raise ConfigError(f"{path} is a {kind} key: Flower's SuperNode authentication takes an EC key on a NIST curve "
                          "(P-256, P-384, P-521); make one with `fedpipe site keygen`")
    return key


def main(argv: list[str] | None = None) -> None:
    """python -m fedpipe.federation.certs FOLDER [SITE ...]: a CA, the SuperLink's certificate, a key pair per site."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("folder")
    p.add_argument("sites", nargs="*")
    a = p.parse_args(argv)
    for name, path in make_tls(a.folder).items():
        print(f"{name}: {path}")
    for s in a.sites:
        print("site key:", *make_site_key(a.folder, s))


if __name__ == "__main__":
    main()
