"""Mutual TLS on the data plane, pinned to the identities in signed membership records.

There is no certificate authority to trust or to run. Each node's certificate is self-signed
with its record key: the RSA key whose signature hivemind's validator checks on the node's
membership record. The record carries the certificate, so the DHT binds it to the peer id as
firmly as it binds everything else the node announces, and a swarm key holder who forges a
record for another id is already refused there.

- A client dials a peer trusting exactly the certificate of that peer's record: a server that
  cannot prove it holds that peer's key fails the handshake, so nobody on the path reads Δ.
- A server requires a client certificate among those of the peers it has read records of,
  and then checks that a stream came over the certificate of the peer id it claims (the
  sender in its chunks): a member can no longer speak as another.
- TLS's record MACs make any flipped byte fail the connection instead of reaching a reducer.

The certificate is a pure function of the key and the peer id (fixed names, validity, serial
from the key, deterministic PKCS#1 v1.5 signature), so a restarted node presents the same
fingerprint, and a record need not carry the certificate: only its signature (344 characters
instead of 1,180 at RSA-2048). A reader rebuilds the rest from the key the record is filed under
and checks that signature: a certificate for any other key or name does not verify. Every find of
the membership key brings every record of the swarm back, so each byte a record sheds is shed n
times by each read (issue 60).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)

# Every certificate names this host; clients check it through `grpc.ssl_target_name_override`,
# since what identifies a peer is its pinned certificate, not the name or address it is dialled at.
TLS_NAME = "peer.dtnode.invalid"
MAX_CERT_CHARS = 4096  # base64 DER of an RSA-4096 self-signed certificate fits with room
MAX_SIGNATURE_CHARS = 1024  # base64 of an RSA-4096 signature (512 bytes) fits with room
# the AlgorithmIdentifier of sha256WithRSAEncryption (RFC 4055), the one our certificates use
_SHA256_WITH_RSA = bytes.fromhex("300d06092a864886f70d01010b0500")
_NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)


class TlsError(ValueError):
    """A certificate that cannot be used: malformed, or not one of ours."""


def fingerprint(der: bytes) -> str:
    """The sha256 of a certificate's DER bytes, hex: what logs and records compare."""
    return hashlib.sha256(der).hexdigest()


def _certificate_builder(public: rsa.RSAPublicKey, peer_id: str) -> x509.CertificateBuilder:
    """Everything of a node's certificate but its signature: a function of its key and id."""
    serial = (
        int.from_bytes(
            hashlib.sha256(
                public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
            ).digest()[:16],
            "big",
        )
        >> 1
    )
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, peer_id[:64] or "dtnode"),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(serial or 1)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    )


def make_certificate(key: rsa.RSAPrivateKey, peer_id: str) -> bytes:
    """The self-signed certificate (DER) of this node's record key."""
    cert = _certificate_builder(key.public_key(), peer_id).sign(key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.DER)


def certificate_signature(der: bytes) -> str:
    """What a record carries of its node's certificate: the signature, base64
    (`certificate_from_signature` rebuilds the rest)."""
    return base64.b64encode(x509.load_der_x509_certificate(der).signature).decode()


@lru_cache(maxsize=1)
def _stand_in_key() -> rsa.RSAPrivateKey:
    """Any RSA key: a certificate signed with it holds the same to-be-signed part as one signed
    with the subject's own key (which names the subject's key and the algorithm, never the
    signer's), and that part is what a record's signature is checked against. 1024 bits: made in
    about 10 ms, and it signs nothing anyone checks."""
    return rsa.generate_private_key(65537, 1024)


def _der(tag: int, content: bytes) -> bytes:
    """One DER element (definite length)."""
    size = len(content)
    if size < 0x80:
        return bytes([tag, size]) + content
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + content


def certificate_from_signature(public: rsa.RSAPublicKey, peer_id: str, text: str) -> bytes:
    """The certificate (DER) of the node whose record, filed under `public` for `peer_id`,
    carries this signature; raises TlsError unless the signature is `public`'s over exactly the
    certificate `make_certificate` makes for that key and id (a record is untrusted input).
    What comes back is byte for byte the certificate the node presents (DER is canonical), so
    its fingerprint is the one a server checks a client's stream against."""
    if not text or len(text) > MAX_SIGNATURE_CHARS:
        raise TlsError("no certificate signature, or one too large")
    try:
        signature = base64.b64decode(text, validate=True)
    except ValueError as e:
        raise TlsError(f"malformed certificate signature: {e}") from None
    to_be_signed = _certificate_builder(public, peer_id).sign(_stand_in_key(), hashes.SHA256()).tbs_certificate_bytes
    try:
        public.verify(signature, to_be_signed, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        raise TlsError("the signature is not this key's over its certificate") from None
    return _der(0x30, to_be_signed + _SHA256_WITH_RSA + _der(0x03, b"\0" + signature))


def encode_certificate(der: bytes) -> str:
    return base64.b64encode(der).decode()


def decode_certificate(text: str) -> bytes:
    """A record's certificate field back to DER; raises TlsError on anything but one RSA
    certificate naming TLS_NAME (what a peer announces is untrusted input)."""
    if not text or len(text) > MAX_CERT_CHARS:
        raise TlsError("no certificate, or one too large")
    try:
        der = base64.b64decode(text, validate=True)
        cert = x509.load_der_x509_certificate(der)
    except ValueError as e:
        raise TlsError(f"malformed certificate: {e}") from None
    if not isinstance(cert.public_key(), rsa.RSAPublicKey) or cert.subject != cert.issuer:
        raise TlsError("not a self-signed RSA certificate")
    if cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[:1] != [
        x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)
    ]:
        raise TlsError("certificate for another name")
    return der


def pem(der: bytes) -> bytes:
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class NodeIdentity:
    """This node's TLS key and certificate, in the forms gRPC takes."""

    key_pem: bytes
    cert_der: bytes

    @classmethod
    def from_key(cls, key: rsa.RSAPrivateKey, peer_id: str) -> NodeIdentity:
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cls(key_pem, make_certificate(key, peer_id))

    @property
    def cert_pem(self) -> bytes:
        return pem(self.cert_der)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_der)


class TrustStore:
    """The certificates of the peers this node has read signed records of, by peer id.

    The membership reader feeds it; the client side takes one peer's certificate as the only
    root for a channel to that peer, the server side takes all as the roots a client
    certificate must be among (re-read by gRPC at each new connection)."""

    MAX_PEERS = 16384  # certificates held; past it the least recently seen peer's is forgotten

    def __init__(self, own: NodeIdentity, own_id: str):
        self.own = own
        self.own_id = own_id
        self._certs: dict[str, bytes] = {own_id: own.cert_der}
        self._seen: dict[str, float] = {}  # peer id -> when its record was last read (least recent first)
        self._texts: dict[str, str] = {}  # the record field each was read from: a repeat costs no parse
        self._by_fingerprint: dict[str, str] = {own.fingerprint: own_id}
        self._lock = threading.Lock()  # gRPC calls the server's fetcher from its own threads
        self._version = 0
        self._served_version = -1

    def learn(self, peer_id: str, cert_text: str) -> bool:
        """Remember a peer's certificate, given whole (base64 DER); False if unusable."""
        return self._learn(peer_id, cert_text, lambda: decode_certificate(cert_text))

    def learn_signed(self, peer_id: str, public: rsa.RSAPublicKey, signature_text: str) -> bool:
        """Remember a peer's certificate from its (already verified) record: the key it is filed
        under and the certificate's signature it carries; False if unusable."""
        return self._learn(peer_id, signature_text, lambda: certificate_from_signature(public, peer_id, signature_text))

    def _learn(self, peer_id: str, text: str, certificate: Callable[[], bytes]) -> bool:
        with self._lock:
            self._seen.pop(peer_id, None)
            self._seen[peer_id] = time.monotonic()
        if self._texts.get(peer_id) == text:
            return True
        try:
            der = certificate()
        except TlsError as e:
            log.debug("peer %s announces an unusable certificate: %s", peer_id, e)
            return False
        with self._lock:
            old = self._certs.get(peer_id)
            while old is None and len(self._certs) >= self.MAX_PEERS:
                self._forget(next(p for p in self._seen if p != peer_id))
            self._texts[peer_id] = text
            if old == der:
                return True
            if old is not None:
                self._by_fingerprint.pop(fingerprint(old), None)
            self._certs[peer_id] = der
            self._by_fingerprint[fingerprint(der)] = peer_id
            self._version += 1
        return True

    def forget_unseen(self, within: float) -> None:
        """Forget the peers whose record was last read more than `within` seconds ago: a store
        that only learnt filled up with records long gone (Sybils), and then learnt nobody."""
        cutoff = time.monotonic() - within
        with self._lock:
            for peer_id in [p for p, at in self._seen.items() if at < cutoff]:
                self._forget(peer_id)

    def _forget(self, peer_id: str) -> None:
        """(under the lock)"""
        self._seen.pop(peer_id, None)
        if peer_id == self.own_id:
            return
        der = self._certs.pop(peer_id, None)
        self._texts.pop(peer_id, None)
        if der is not None:
            self._by_fingerprint.pop(fingerprint(der), None)
            self._version += 1

    @property
    def size(self) -> int:
        """Certificates held now, this node's own included."""
        return len(self._certs)

    def certificate(self, peer_id: str) -> bytes | None:
        with self._lock:
            return self._certs.get(peer_id)

    def fingerprint_of(self, peer_id: str) -> str | None:
        der = self.certificate(peer_id)
        return fingerprint(der) if der is not None else None

    def peer_of(self, fingerprint_hex: str | None) -> str | None:
        with self._lock:
            return self._by_fingerprint.get(fingerprint_hex or "")

    def channel_credentials(self, peer_id: str) -> grpc.ChannelCredentials:
        """Credentials that trust only `peer_id`'s certificate and present ours."""
        der = self.certificate(peer_id)
        if der is None:
            raise TlsError(f"no certificate known for peer {peer_id}")
        return grpc.ssl_channel_credentials(
            root_certificates=pem(der), private_key=self.own.key_pem, certificate_chain=self.own.cert_pem
        )

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        with self._lock:
            roots = b"".join(pem(der) for der in self._certs.values())
            self._served_version = self._version
        return grpc.ssl_server_certificate_configuration([(self.own.key_pem, self.own.cert_pem)], roots)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks before each new connection: new roots only when a peer was learnt since."""
        if self._served_version == self._version:
            return None
        return self._configuration()

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), self._fetch, require_client_authentication=True
        )


def client_fingerprint(context: grpc.aio.ServicerContext) -> str | None:
    """The fingerprint of the certificate the stream's client presented, if any."""
    certs = context.auth_context().get("x509_pem_cert") or []
    if not certs:
        return None
    try:
        cert = x509.load_pem_x509_certificate(certs[0])
    except ValueError:
        return None
    return fingerprint(cert.public_bytes(serialization.Encoding.DER))
