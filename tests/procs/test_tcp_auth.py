"""TCP only with authentication: mutual TLS or a bearer token over TLS, else refused to start.

Certificates are made in the test (a CA, the daemon's certificate for 127.0.0.1, a client
certificate, and a certificate from another CA). Real daemon processes, real handshakes.
"""

from __future__ import annotations

import datetime
import ipaddress
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hicache.errors import HiCacheError
from hicache_client import HiCacheClient
from tests.daemon_proc import DaemonProc, start_daemon

TOKEN = "t0k3n-" + "x" * 26


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, ca: bool, server: bool = False
          ) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(issuer.subject if issuer else
                      x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    ca: bytes
    client_cert: bytes
    client_key: bytes
    rogue_cert: bytes
    """Signed by another CA."""
    rogue_key: bytes
    ca_path: Path
    server_cert_path: Path
    server_key_path: Path
    token_path: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key = _key(), _key()
    ca = _cert("hicache-test-ca", ca_key, None, ca_key, ca=True)
    other_ca = _cert("someone-else", other_key, None, other_key, ca=True)
    srv_key, cli_key, rogue_key = _key(), _key(), _key()

    def pem(cert: x509.Certificate) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    files = {"ca": pem(ca), "server_cert": pem(_cert("hicached", srv_key, ca, ca_key, ca=False,
                                                     server=True)),
             "server_key": _pem_key(srv_key)}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    (d / "token").write_text(TOKEN + "\n")
    return Pki(ca=files["ca"], client_cert=pem(_cert("worker", cli_key, ca, ca_key, ca=False)),
               client_key=_pem_key(cli_key),
               rogue_cert=pem(_cert("rogue", rogue_key, other_ca, other_key, ca=False)),
               rogue_key=_pem_key(rogue_key), ca_path=d / "ca.pem",
               server_cert_path=d / "server_cert.pem", server_key_path=d / "server_key.pem",
               token_path=d / "token")


def tcp_daemon(tmp_path: Path, pki: Pki, *auth: str) -> tuple[DaemonProc, str]:
    """A daemon with TLS on a free loopback port, plus ``auth`` flags; and its TCP target."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    d = start_daemon(tmp_path, "--listen", f"127.0.0.1:{port}", "--tls-cert",
                     str(pki.server_cert_path), "--tls-key", str(pki.server_key_path), *auth)
    return d, f"127.0.0.1:{port}"


def test_plain_tcp_is_refused_unless_asked_for(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    d = start_daemon(tmp_path, "--listen", f"127.0.0.1:{port}", wait=False)
    assert d.proc.wait(30) == 2
    assert "without client authentication" in d.log() and "insecure_tcp" in d.log()
    ok = start_daemon(tmp_path, "--listen", f"127.0.0.1:{port}", "--insecure-tcp")
    try:
        with HiCacheClient(f"127.0.0.1:{port}") as c:
            assert c.get_info().serving
    finally:
        ok.stop(signal.SIGKILL)


def test_mutual_tls_admits_only_clients_the_ca_signed(tmp_path: Path, pki: Pki) -> None:
    d, target = tcp_daemon(tmp_path, pki, "--tls-client-ca", str(pki.ca_path))
    try:
        with HiCacheClient(target, tls_ca=pki.ca, tls_cert=pki.client_cert,
                           tls_key=pki.client_key) as good:
            assert good.get_info().serving
        for cert, key in ((None, None), (pki.rogue_cert, pki.rogue_key)):
            with HiCacheClient(target, tls_ca=pki.ca, tls_cert=cert, tls_key=key,
                               reconnect_seconds=0, timeout=5) as bad:
                with pytest.raises(HiCacheError) as exc:
                    bad.get_info()
                assert exc.value.reason == "UNAVAILABLE"  # the handshake itself failed
        # the Unix socket next to it needs none of this
        with HiCacheClient(d.target) as local:
            assert local.get_info().serving
    finally:
        d.stop(signal.SIGKILL)


def test_bearer_token_over_tls(tmp_path: Path, pki: Pki) -> None:
    d, target = tcp_daemon(tmp_path, pki, "--auth-token-file", str(pki.token_path))
    try:
        with HiCacheClient(target, tls_ca=pki.ca, auth_token=TOKEN) as good:
            assert good.get_info().serving
            assert good.list_pools() == []
        for token in (None, TOKEN + "x", "wrong"):
            with HiCacheClient(target, tls_ca=pki.ca, auth_token=token,
                               reconnect_seconds=0) as bad:
                with pytest.raises(HiCacheError) as exc:
                    bad.list_pools()
                assert exc.value.reason == "UNAUTHENTICATED", exc.value
                assert bad.health()  # health stays open to probes
        with HiCacheClient(d.target) as local:  # Unix-socket callers are not asked
            assert local.list_pools() == []
    finally:
        d.stop(signal.SIGKILL)
