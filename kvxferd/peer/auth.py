"""Who a peer is: certificate-bound daemon ids (mTLS) or a shared-secret proof (HMAC), checked
before anything a peer claims is believed.

- mTLS (`tls_client_auth`): a certificate names the daemon ids its holder may use, as URI SANs
  `kvxferd://daemon/<id>`; a certificate with no such URI names its subject CN. A Handshake,
  Session Hello or Heartbeat claiming another id is refused, and a daemon dialing out checks that
  the server's certificate names the id its handshake reply claims.
  A certificate that carries any URI SAN is judged by its URIs alone: its CN is used only when
  it has no URI SAN at all (a certificate naming `spiffe://...` and the victim's id in its CN
  names nobody), so an id cannot be borrowed from a CN that a URI-issuing CA never checked.
- Shared secret (`peer_secret_file`, or by default the per-host secret of the daemon's uid,
  kvxferd.peer.host_secret, mode `host-secret`): a handshake takes two round trips. The first
  (Challenge) returns the responder's instance id and a fresh single-use challenge nonce and
  nothing else. The handshake request then carries an HMAC-SHA256 over the sender's daemon id,
  instance id, address, NIXL agent name, a digest of its NIXL metadata, a fresh nonce, a
  timestamp, and the responder's instance id and challenge: a captured request is worthless once
  that challenge is used, expired, or the responder restarted (a new instance never issued it),
  which a nonce cache dying with the process could not promise. The reply carries the
  responder's own HMAC over the same for its side plus both nonces, so both sides authenticate.
  Nothing else (no NIXL metadata, no peer-table change, a claimed restart of a known daemon
  included) happens before the request's proof holds. A Session Hello carries an HMAC over its
  sender and both nonces of a handshake the receiver completed with that exact instance.
  Rotation: a changed file is re-read; the previous secret is still accepted for
  `peer_secret_overlap_s`. A requester signs with its newest secret and, if refused, once more with
  the previous one (the peer may not be rotated yet); a responder answers with the secret that
  verified the request.
- `insecure` (only with `insecure_peers = true`, loopback or not): plaintext peers, no proof.

Refusals are counted (kvxferd_peer_refusals) and logged at most once per LOG_EVERY_S.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2
from kvxferd.config import PEER_AUTH_MODES, Config, ConfigError, read_secret_file, split_hostport
from kvxferd.core.types import DaemonRef
from kvxferd.errors import PermissionDenied
from kvxferd.ops.metrics import Metrics
from kvxferd.peer import host_secret

logger = logging.getLogger(__name__)

CERT_ID_PREFIX = "kvxferd://daemon/"
# Handshake timestamps further than this from our clock are refused (replays, wrong clocks).
MAX_SKEW_S = 60.0
LOG_EVERY_S = 10.0
NONCE_BYTES = 16
# Challenges issued and not yet used: how many at most (the oldest goes first) and for how long.
# A flood of Challenge calls can only evict challenges (a legitimate requester then retries).
_CHALLENGES = 4096
CHALLENGE_TTL_S = 30.0
# How often the secret file is stat'ed for a rotation, at most.
_STAT_EVERY_S = 1.0


@dataclass(frozen=True)
class PeerCreds:
    """What the transport proved about a caller: the daemon ids its certificate names, or None
    when no certificate was checked (not mTLS)."""

    cert_ids: frozenset[str] | None = None


@dataclass(frozen=True)
class Challenge:
    """What a responder chose for one handshake (peer.proto ChallengeReply): the request's proof
    must cover both, so it is good for this instance and this one handshake only."""

    instance_id: str = ""
    nonce: bytes = b""


@dataclass(frozen=True)
class Proof:
    """One side's HMAC proof (peer.proto PeerProof)."""

    nonce: bytes = b""
    unix_ms: int = 0
    mac: bytes = b""
    peer_nonce: bytes = b""


# The handshake both sides completed: (requester's nonce, responder's nonce, the secret it used).
# A Session Hello must name the nonces of one the receiver holds for that instance.
Binding = tuple[bytes, bytes, bytes]
NO_BINDING: Binding = (b"", b"", b"")


def ids_from_auth_context(ctx: Mapping[str, Sequence[bytes]]) -> frozenset[str]:
    """Daemon ids named by the client certificate gRPC verified (`ServicerContext.auth_context()`)."""
    uris = [u.decode(errors="replace") for u in ctx.get("peer_uri", ())]
    cns = [c.decode(errors="replace") for c in ctx.get("x509_common_name", ())]
    return _cert_ids(uris, cns)


def ids_from_peercert(cert: Mapping[str, object]) -> frozenset[str]:
    """The same from Python ssl's getpeercert() dict."""
    sans = cert.get("subjectAltName", ())
    uris = [v for k, v in sans if k == "URI"] if isinstance(sans, tuple) else []
    subject = cert.get("subject", ())
    cns = [v for rdn in subject for k, v in rdn if k == "commonName"] if isinstance(subject, tuple) else []
    return _cert_ids(uris, cns)


def _cert_ids(uris: Sequence[str], cns: Sequence[str]) -> frozenset[str]:
    if uris:  # (any URI SAN, ours or not: the CN is not a fallback then)
        return frozenset(u[len(CERT_ID_PREFIX):] for u in uris if u.startswith(CERT_ID_PREFIX))
    return frozenset(cns)


def client_tls_context(config: Config) -> ssl.SSLContext:
    """TLS for dialing a peer, as our gRPC channels have it: the peer's certificate checked
    against our CA (the system's without one) and the host we dial, ours presented."""
    ctx = ssl.create_default_context(cafile=config.tls_ca or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    return ctx


def _mac(key: bytes, label: str, *parts: bytes | str | int) -> bytes:
    # Length-prefixed fields: no two different field lists hash the same bytes.
    h = hmac.new(key, label.encode(), hashlib.sha256)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(b).to_bytes(4, "big"))
        h.update(b)
    return h.digest()


def _digest(metadata: bytes) -> bytes:
    return hashlib.sha256(metadata).digest()


class _Secret:
    """The shared secret, re-read when its file changes; the previous one stays valid for the
    overlap so that a fleet can be rotated one node at a time."""

    def __init__(self, path: str, overlap_s: float, read: Callable[[str], bytes] = read_secret_file) -> None:
        self._path = path
        self._overlap = overlap_s
        self._read = read
        self._current = read(path)  # (first: the host secret may not exist before this)
        self._stamp = self._stat()
        self._previous: bytes | None = None
        self._previous_until = 0.0
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int, int]:
        st = os.stat(self._path)
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode

    def keys(self) -> list[bytes]:
        """Keys to accept, the one to sign with first."""
        now = time.monotonic()
        if now - self._checked >= _STAT_EVERY_S:
            self._checked = now
            self._reload(now)
        if self._previous is not None and now < self._previous_until:
            return [self._current, self._previous]
        return [self._current]

    def _reload(self, now: float) -> None:
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            fresh = self._read(self._path)
        except (OSError, ConfigError) as exc:
            logger.error("peer secret not reloaded, the current one stays in use: %s", exc)
            return
        self._stamp = stamp
        if fresh != self._current:
            self._previous, self._current = self._current, fresh
            self._previous_until = now + self._overlap
            logger.info("peer secret rotated; the previous one is accepted for %.0f s more", self._overlap)


class PeerAuth:
    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.mode = config.peer_auth_mode
        self._config = config
        self._metrics = metrics
        self._secret: _Secret | None = None
        if self.mode == "secret":
            self._secret = _Secret(config.peer_secret_file, config.peer_secret_overlap_s)
        elif self.mode == "host-secret":
            path = config.host_secret_file or host_secret.default_path()
            self._secret = _Secret(path, config.peer_secret_overlap_s, host_secret.load)
            logger.info("peers authenticate with the host secret of uid %d at %s", os.geteuid(), path)
        self._challenges: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._log_at = 0.0
        self._unlogged = 0
        for mode in PEER_AUTH_MODES:
            metrics.peer_auth_mode.labels(mode=mode).set(1 if mode == self.mode else 0)

    @property
    def uses_secret(self) -> bool:
        return self._secret is not None

    def refused(self, reason: str, detail: str) -> None:
        """Counts a refused peer request and logs it, rate-limited: a flood costs one line per LOG_EVERY_S."""
        self._metrics.peer_refusals.labels(reason=reason).inc()
        now = time.monotonic()
        if now < self._log_at:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last line)" if self._unlogged else ""
        logger.warning("peer request refused (%s): %s%s", reason, detail[:300], more)
        self._log_at, self._unlogged = now + LOG_EVERY_S, 0

    # ------------------------------------------------------------------ certificates

    def check_claim(self, creds: PeerCreds, daemon_id: str) -> None:
        """The caller's certificate must name the daemon id it claims (mTLS only)."""
        if self.mode != "mtls":
            return
        if creds.cert_ids is None or daemon_id not in creds.cert_ids:
            named = sorted(creds.cert_ids or ())[:4]
            raise PermissionDenied(f"daemon id {daemon_id[:100]!r} is not named by the peer's certificate {named}")

    async def server_ids(self, address: str, timeout: float) -> PeerCreds:
        """The daemon ids named by the certificate the peer service at `address` presents.
        gRPC's Python channels do not expose the server certificate, so this is read on a TLS
        connection of its own, verified the same way (our CA, our client certificate)."""
        if self.mode != "mtls":
            return PeerCreds()
        ctx = client_tls_context(self._config)
        ctx.set_alpn_protocols(["h2"])
        host, port = split_hostport(address)
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=host), timeout)
        try:
            cert = writer.get_extra_info("peercert") or {}
        finally:
            writer.close()
        return PeerCreds(ids_from_peercert(cert))

    # ------------------------------------------------------------------ shared secret

    def _keys(self) -> list[bytes]:
        assert self._secret is not None
        return self._secret.keys()

    def signing_keys(self) -> list[bytes]:
        """Secrets to try, newest first ([b""] without a secret: one attempt, no proof)."""
        return self._keys() if self._secret is not None else [b""]

    def challenge(self) -> bytes:
        """A fresh single-use nonce for one handshake with this instance (the Challenge RPC)."""
        now = time.monotonic()
        while self._challenges and (next(iter(self._challenges.values())) < now
                                    or len(self._challenges) >= _CHALLENGES):
            self._challenges.popitem(last=False)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._challenges[nonce] = now + CHALLENGE_TTL_S
        return nonce

    async def challenge_of(self, stub: Any, timeout: float) -> Challenge:
        """The responder's challenge (a Peer stub's Challenge RPC); none needed without a secret."""
        if self._secret is None:
            return Challenge()
        c = await stub.Challenge(peer_pb2.ChallengeRequest(), timeout=timeout)
        return Challenge(c.instance_id, bytes(c.nonce))

    def request_proof(self, me: DaemonRef, agent: str, metadata: bytes, key: bytes,
                      challenge: Challenge) -> Proof | None:
        if self._secret is None:
            return None
        nonce, ms = secrets.token_bytes(NONCE_BYTES), int(time.time() * 1000)
        mac = _mac(key, "kvxferd/2 handshake", me.daemon_id, me.instance_id, me.address, agent,
                   _digest(metadata), nonce, ms, challenge.instance_id, challenge.nonce)
        return Proof(nonce, ms, mac, challenge.nonce)

    def verify_request(self, ref: DaemonRef, agent: str, metadata: bytes, proof: Proof | None,
                       my_instance: str) -> tuple[bytes, bytes]:
        """The requester's nonce and the secret it used, once its proof holds and covers a
        challenge this instance issued and nobody used yet; PermissionDenied otherwise. Called
        before anything else: a claimed restart of a known daemon needs it as much as a first
        handshake does."""
        if self._secret is None:
            return b"", b""
        if proof is None or len(proof.nonce) != NONCE_BYTES:
            raise PermissionDenied("this daemon requires a peer secret proof in the handshake")
        now = time.time()
        if abs(now - proof.unix_ms / 1000) > MAX_SKEW_S:
            raise PermissionDenied(f"handshake timestamp is more than {MAX_SKEW_S:.0f} s from this daemon's clock")
        expires = self._challenges.get(proof.peer_nonce)
        if expires is None or expires < time.monotonic():
            raise PermissionDenied("handshake challenge unknown, expired or used: ask for a new one (a replay?)")
        key = next((k for k in self._keys() if hmac.compare_digest(proof.mac, _mac(
            k, "kvxferd/2 handshake", ref.daemon_id, ref.instance_id, ref.address, agent, _digest(metadata),
            proof.nonce, proof.unix_ms, my_instance, proof.peer_nonce))), None)
        if key is None:
            raise PermissionDenied("handshake proof does not match the peer secret")
        # Used once only; a wrong proof above leaves it for the requester's retry with its previous secret.
        del self._challenges[proof.peer_nonce]
        return proof.nonce, key

    def reply_proof(self, me: DaemonRef, agent: str, metadata: bytes, requester: DaemonRef,
                    their_nonce: bytes, key: bytes) -> tuple[Proof | None, Binding]:
        if self._secret is None:
            return None, NO_BINDING
        nonce = secrets.token_bytes(NONCE_BYTES)
        mac = _mac(key, "kvxferd/1 handshake reply", me.daemon_id, me.instance_id, me.address, agent,
                   _digest(metadata), requester.instance_id, their_nonce, nonce)
        return Proof(nonce, 0, mac, their_nonce), (their_nonce, nonce, key)

    def verify_reply(self, ref: DaemonRef, agent: str, metadata: bytes, me: DaemonRef, sent: Proof | None,
                     key: bytes, proof: Proof | None, challenge: Challenge | None = None) -> Binding:
        """The responder must answer with the secret our request was signed with, as the
        instance that challenged us."""
        if self._secret is None or sent is None:
            return NO_BINDING
        if challenge is not None and challenge.instance_id != ref.instance_id:
            raise PermissionDenied(f"peer {ref.daemon_id[:100]!r} answered as another instance than it challenged as")
        if proof is None or proof.peer_nonce != sent.nonce or len(proof.nonce) != NONCE_BYTES:
            raise PermissionDenied(f"peer {ref.daemon_id[:100]!r} did not prove it holds the peer secret")
        want = _mac(key, "kvxferd/1 handshake reply", ref.daemon_id, ref.instance_id, ref.address, agent,
                    _digest(metadata), me.instance_id, sent.nonce, proof.nonce)
        if not hmac.compare_digest(want, proof.mac):
            raise PermissionDenied(f"peer {ref.daemon_id[:100]!r}: handshake reply proof does not match the peer secret")
        return sent.nonce, proof.nonce, key

    def hello_proof(self, me: DaemonRef, peer_instance: str, binding: Binding | None) -> Proof | None:
        if self._secret is None or binding is None:
            return None
        nonce, peer_nonce, key = binding
        mac = _mac(key, "kvxferd/1 hello", me.daemon_id, me.instance_id, peer_instance, nonce, peer_nonce)
        return Proof(nonce, 0, mac, peer_nonce)

    def verify_hello(self, ref: DaemonRef, peer_instance: str, proof: Proof | None,
                     bindings: Sequence[Binding]) -> None:
        """A stream's Hello must be bound to a handshake completed with that exact instance."""
        if self._secret is None:
            return
        key = next((b[2] for b in bindings if b[:2] == (proof.nonce, proof.peer_nonce)), None) if proof else None
        if proof is None or key is None:
            raise PermissionDenied("the stream's Hello names no handshake completed with this daemon")
        want = _mac(key, "kvxferd/1 hello", ref.daemon_id, ref.instance_id, peer_instance, proof.nonce,
                    proof.peer_nonce)
        if not hmac.compare_digest(want, proof.mac):
            raise PermissionDenied("the stream's Hello proof does not match the peer secret")
