"""Throwaway certificates for the TLS tests: a CA, a server certificate for 127.0.0.1, a client certificate.

Made by the openssl command line when there is one, else by the cryptography package; a test needing
them is skipped (saying why) when neither is here.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

FILES = ("ca.pem", "server.pem", "server.key", "other-ca.pem", "client.pem", "client.key")


@dataclasses.dataclass(frozen=True)
class Certs:
    """PEM files: a throwaway CA, the certificate for IP 127.0.0.1 it signed and its key, a client certificate
    it signed and its key, and a CA that signed nothing."""

    ca: str
    cert: str
    key: str
    other_ca: str
    client_cert: str
    client_key: str

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


# Extensions as strict verification (Python 3.13's default context) wants them: critical basic
# constraints, key identifiers on both sides, the address in subjectAltName (a CN is not looked at).
OPENSSL_CNF = """\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def openssl_certs(openssl: str, folder: Path) -> Certs:
    """The Certs made by the openssl command line (P-256 keys: quick to make), in `folder`."""
    (folder / "openssl.cnf").write_text(OPENSSL_CNF)

    def sh(*args: str) -> None:
        done = subprocess.run([openssl, *args], cwd=folder, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"openssl {args[0]} failed: {done.stderr}"

    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-config", "openssl.cnf")
    for name in ("ca", "other-ca"):
        sh("req", "-x509", *new_key, "-extensions", "ca", "-subj", f"/CN=engines test {name}", "-days", "1",
           "-keyout", f"{name}.key", "-out", f"{name}.pem")  # fmt: skip
    for name, cn in (("server", "127.0.0.1"), ("client", "a test client")):
        sh("req", "-new", *new_key, "-subj", f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        sh("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-days", "1",
           "-set_serial", str(random.getrandbits(63)), "-extfile", "openssl.cnf", "-extensions", name,
           "-out", f"{name}.pem")  # fmt: skip
    return Certs(*(str(folder / f) for f in FILES))


def cryptography_certs(folder: Path) -> Certs:
    """The same Certs made with the cryptography package."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, name: str) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        ca = issuer is None
        signer_cert, signer_key = issuer or (None, key)
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject if ca else signer_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.KeyUsage(not ca, False, False, False, False, ca, ca, False, False), critical=True)
        )
        if not ca:
            usage = ExtendedKeyUsageOID.CLIENT_AUTH if name == "client" else ExtendedKeyUsageOID.SERVER_AUTH
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(signer_key.public_key()), critical=False
            )
            if name == "server":
                b = b.add_extension(
                    x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
                )
        cert = b.sign(signer_key, hashes.SHA256())
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem_key = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        (folder / f"{name}.key").write_bytes(pem_key)
        return cert, key

    ca = issue("engines test ca", None, "ca")
    issue("engines test other-ca", None, "other-ca")
    issue("127.0.0.1", ca, "server")
    issue("a test client", ca, "client")
    return Certs(*(str(folder / f) for f in FILES))


def make_certs(folder: Path) -> Certs:
    if openssl := shutil.which("openssl"):
        return openssl_certs(openssl, folder)
    try:
        import cryptography  # noqa: F401
    except ImportError:
        pytest.skip("a throwaway CA needs the openssl command or the cryptography package: neither is here")
    return cryptography_certs(folder)
