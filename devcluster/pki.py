"""Credentials for the local control plane: a CA, the apiserver serving certificate, the ServiceAccount
signing key, and an admin bearer token. Generated once per cluster directory. `issue` adds the certificates a
real node needs (its kubelet's client and serving pairs, the apiserver's kubelet client, kube-proxy, CoreDNS),
signed by the same CA, as kubeadm does."""
from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import NameOID

# The first address of the service CIDR, which the apiserver's own `kubernetes` Service gets.
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"


@dataclass(frozen=True)
class Credentials:
    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    @property
    def token_file(self) -> Path:
        return self.dir / "tokens.csv"

    def token(self, user: str) -> str:
        for line in self.token_file.read_text().splitlines():
            token, name = line.split(",")[:2]
            if name == user:
                return token
        raise KeyError(user)

    @property
    def admin_token(self) -> str:
        return self.token("admin")


def _write_key(path: Path, key: PrivateKeyTypes) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _load_ca(creds: Credentials) -> tuple[x509.Certificate, PrivateKeyTypes]:
    cert = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(creds.ca_key.read_bytes(), password=None)
    return cert, key


def issue(creds: Credentials, name: str, common_name: str, organizations: tuple[str, ...] = (),
          *, client: bool = True, dns_names: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> KeyPair:
    """A key pair `<name>.crt/.key` beside the CA, signed by it. Kubernetes reads the identity from the subject:
    CN is the user, each O a group (system:node:<n> in system:nodes is a Node-authorized kubelet). With SANs it
    is also a serving certificate."""
    pair = KeyPair(creds.dir / f"{name}.crt", creds.dir / f"{name}.key")
    ca_cert, ca_key = _load_ca(creds)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                         *(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations)])
    usages = [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        usages.append(x509.oid.ExtendedKeyUsageOID.SERVER_AUTH)
    cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(ca_key, hashes.SHA256())
    _write_key(pair.key, key)
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def ensure_credentials(directory: Path, extra_ips: tuple[str, ...] = ()) -> Credentials:
    """`extra_ips`: more addresses the apiserver answers on (a real node's pods reach it on the host's IP)."""
    creds = Credentials(directory)
    if creds.token_file.exists():
        return creds
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    not_after = now + dt.timedelta(days=365)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "disagg-devcluster-ca")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(creds.ca_key, ca_key)
    creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    srv_key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [
        x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                  "kubernetes.default.svc.cluster.local")]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", KUBERNETES_SERVICE_IP, *extra_ips)]
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(creds.serving_key, srv_key)
    creds.serving_cert.write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(creds.sa_key, sa_key)
    creds.sa_pub.write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    # Static token auth: an admin identity for tests and the demo, and a second cluster-admin identity the
    # benchmarks give the operator so the audit log can tell its requests apart. Anything narrower (the
    # chart's ServiceAccount) goes through real ServiceAccount tokens and RBAC.
    creds.token_file.write_text(f'{secrets.token_hex(24)},admin,admin,"system:masters"\n'
                                f'{secrets.token_hex(24)},disagg-operator,disagg-operator,"system:masters"\n')
    creds.token_file.chmod(0o600)
    return creds
