"""TLS for a node's listeners and dialers: the `ssl` contexts built from the node's settings, the
client-side context of warrenctl and of clients, and a local certificate authority for `make certs`.

A node with `tls_cert` set speaks TLS on:

* the peer port, only (the plain listener is replaced): mutual TLS, the node's own certificate
  presented both when it accepts and when it dials, every peer's checked against `tls_ca` and
  required whatever `tls_verify_peer` says, in addition to the cluster secret;
* warren's client port, only (replaced as well);
* a second AMQP port, `amqps_port` (5671, RabbitMQ's), beside the plain `amqp_port`;
* the management HTTP port, when there is one.

On the client-facing ports `tls_verify_peer` asks a client for a certificate and checks any it
gives against `tls_ca`; `tls_fail_if_no_peer_cert` then refuses a client that gives none (the
two settings RabbitMQ's `ssl_options` has under the same names).

`python -m broker.tls certs DIR [--nodes N] [--hosts NAME,...]` writes a CA (ca.pem), a
certificate and key per node (nN.pem, nN.key: valid as server and as client, for localhost,
127.0.0.1 and the node's name, which is its compose host name) and a client certificate
(client.pem, client.key), with the `cryptography` package.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

class TlsError(Exception):
    """A TLS setting that cannot be used (a file missing, a key that does not match)."""


@dataclass(frozen=True)
class NodeTls:
    """A node's contexts: `peer_server`/`peer_dial` for the peer port (mutual), `clients` for the
    client, AMQPS and HTTP ports."""

    peer_server: ssl.SSLContext
    peer_dial: ssl.SSLContext
    clients: ssl.SSLContext


def _load(ctx: ssl.SSLContext, cert: str, key: str, ca: str) -> ssl.SSLContext:
    for path in (cert, key, ca):
        if path and not Path(path).is_file():
            raise TlsError(f"cannot read {path}: no such file")
    try:
        if cert:
            ctx.load_cert_chain(cert, key or None)
        if ca:
            ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise TlsError(f"unusable certificate, key or CA ({cert}, {key}, {ca}): {exc.reason or exc}") from None
    except OSError as exc:
        raise TlsError(f"cannot read {cert}, {key} or {ca}: {exc.strerror or exc}") from None
    return ctx


def server_context(cert: str, key: str, ca: str, verify_peer: bool, fail_if_no_peer_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, cert, key, ca)
    if fail_if_no_peer_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
    elif verify_peer:
        ctx.verify_mode = ssl.CERT_OPTIONAL
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def client_context(cert: str = "", key: str = "", ca: str = "", verify: bool = True) -> ssl.SSLContext:
    """The dialing side: checks the server's certificate against `ca` (the system's CAs if none)
    and its host name, unless `verify` is false; presents `cert` if given."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, cert, key, ca)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def node_contexts(config) -> NodeTls | None:
    """The contexts of a node's settings (None: TLS is off)."""
    if not config.tls_cert:
        return None
    cert, key, ca = config.tls_cert, config.tls_key, config.tls_ca
    if not ca:
        raise TlsError("tls_cert is set but tls_ca is not: the peer port checks every node's "
                       "certificate against that CA")
    return NodeTls(peer_server=server_context(cert, key, ca, True, True),
                   peer_dial=client_context(cert, key, ca),
                   clients=server_context(cert, key, ca, config.tls_verify_peer,
                                          config.tls_fail_if_no_peer_cert))


# --- a local certificate authority ---------------------------------------------------------------

def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "warren local"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(directory: Path, common_name: str = "warren local CA", prefix: str = "ca"):
    """A self-signed CA (PREFIX.pem, PREFIX.key); returns (certificate, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    key = _key()
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / f"{prefix}.pem", _pem_cert(cert))
    _write(directory / f"{prefix}.key", _pem_key(key), private=True)
    return cert, key


def make_cert(directory: Path, stem: str, ca, hosts: list[str] = (), *, days: float = 825,
              expired: bool = False) -> tuple[Path, Path]:
    """A certificate signed by `ca` (its (certificate, key)), for server and client use, naming
    `hosts` (names and IP addresses); `expired` makes one whose validity ended yesterday.
    Writes STEM.pem and STEM.key; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    ca_cert, ca_key = ca
    key = _key()
    now = _now()
    start, end = ((now - datetime.timedelta(days=30), now - datetime.timedelta(days=1)) if expired
                  else (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)))
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    builder = (x509.CertificateBuilder().subject_name(_name(stem)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    _write(cert_path, _pem_cert(cert))
    _write(key_path, _pem_key(key), private=True)
    return cert_path, key_path


def make_certs(directory: Path, nodes: int = 3, hosts: list[str] = ()) -> list[Path]:
    """What `make certs` writes: the CA, n1..nN (each for localhost, 127.0.0.1, its own name and
    `hosts`) and client; returns the files written."""
    directory = Path(directory)
    ca = make_ca(directory)
    written = [directory / "ca.pem", directory / "ca.key"]
    for i in range(1, nodes + 1):
        written += make_cert(directory, f"n{i}", ca, ["localhost", "127.0.0.1", "::1", f"n{i}", *hosts])
    written += make_cert(directory, "client", ca)
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m broker.tls",
                                description="Make a local CA and node and client certificates.")
    p.add_argument("action", choices=["certs"])
    p.add_argument("directory", type=Path)
    p.add_argument("--nodes", type=int, default=3, help="node certificates n1..nN (default 3)")
    p.add_argument("--hosts", default="", help="more names or addresses for every node certificate, NAME,...")
    args = p.parse_args(argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    for path in make_certs(args.directory, args.nodes, hosts):
        print(path)


if __name__ == "__main__":
    main()
