"""A try-out CA, the SuperLink's TLS certificate and the sites' authentication keys.

TLS: the SuperLink serves its HTTPS API (Fleet, Control and Runtime on one port in Flower 1.42,
flwr/superlink/cli/flower_superlink.py `_run_superlink_http_api`) with `--ssl-certfile/--ssl-keyfile`;
SuperNodes, SuperExec and the `flwr` CLI verify it against the CA (`--root-certificates`, and
`root-certificates` of the SuperLink connection in $FLWR_HOME/config.toml).

Site keys: SuperNode authentication takes an EC key on a NIST curve in OpenSSH format: the private key
for `flower-supernode --auth-supernode-private-key` (flwr/supernode/cli/flower_supernode.py) and the
public key for `flwr supernode register` (flwr/cli/supernode/register.py, `try_load_public_key`).
For a try-out only: a real deployment keeps the CA key offline and each site makes its own key pair.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def make_tls(folder: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 30) -> dict[str, Path]:
    """ca.crt (+ ca.key), server.crt and server.key for `hosts`, in `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpipe try-out CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA384()))
    key = ec.generate_private_key(ec.SECP384R1())
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if h.replace(".", "").isdigit() or ":" in h else x509.DNSName(h) for h in hosts]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA384()))
    return {
        "ca_cert": _write(folder / "ca.crt", ca.public_bytes(serialization.Encoding.PEM)),
        "ca_key": _write(folder / "ca.key", _key_pem(ca_key), private=True),
        "server_cert": _write(folder / "server.crt", cert.public_bytes(serialization.Encoding.PEM)),
        "server_key": _write(folder / "server.key", _key_pem(key), private=True),
    }


def make_site_key(folder: str | Path, name: str) -> tuple[Path, Path]:
    """<name>.key (OpenSSH private) and <name>.pub (OpenSSH public), P-384."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return _write(folder / f"{name}.key", private, private=True), _write(folder / f"{name}.pub", public + b"\n")


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
