"""CURVE authentication: the key directory `specserve keys generate` writes, and the socket
options and ZAP handler (libzmq's CURVE, pyzmq's `zmq.auth`) that use it.

A key directory holds, as ZeroMQ certificate files (`NAME.key` public, `NAME.key_secret` both):

    control.key  control.key_secret        the control plane's pair
    workers/NAME.key  workers/NAME.key_secret   one pair per worker (or one shared by a fleet)
    clients/NAME.key  clients/NAME.key_secret   one pair per client

The control plane needs its own pair and the *public* keys of workers/ and clients/ (its two
allow-lists); a worker needs control.key and its own pair under workers/; a client control.key
and its own pair under clients/. Each part can therefore be mounted from its own Kubernetes
Secret. Worker keys are only accepted on the worker port and client keys only on the client
port (a ZAP domain each), so a client key can never act as a worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from specserve.shared.paths import cache_root

CONTROL = "control"
WORKERS = "workers"
CLIENTS = "clients"
DEFAULT_WORKER_KEY = "worker"
DEFAULT_CLIENT_KEY = "client"


class KeysError(ValueError):
    """A key directory or certificate file that cannot be used; the message says which."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes


def generate_keys(
    directory: str | Path,
    workers: tuple[str, ...] = (DEFAULT_WORKER_KEY,),
    clients: tuple[str, ...] = (DEFAULT_CLIENT_KEY,),
) -> list[Path]:
    """Write the control plane's pair and one pair per named worker and client into
    `directory` (mode 0700, secret files 0600); existing files are never overwritten."""
    root = Path(directory)
    wanted = [(root, CONTROL)]
    wanted += [(root / WORKERS, name) for name in workers]
    wanted += [(root / CLIENTS, name) for name in clients]
    existing = [d / f"{n}.key_secret" for d, n in wanted if (d / f"{n}.key_secret").exists()]
    if existing:
        raise KeysError(f"{existing[0]} exists; keys are never overwritten (remove it first)")
    written = []
    for folder, name in wanted:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        public, secret = zmq.auth.create_certificates(folder, name)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    return written


def load_pair(path: str | Path) -> KeyPair:
    """A `.key_secret` certificate: both keys."""
    public, secret = _load(path)
    if secret is None:
        raise KeysError(f"{path} holds no secret key (a .key_secret file is needed)")
    return KeyPair(public, secret)


def load_public(path: str | Path) -> bytes:
    return _load(path)[0]


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read the key {path}: {exc}") from None


def allowed_keys(folder: str | Path) -> set[bytes]:
    """The public keys of every `.key` file in `folder`: one role's allow-list."""
    if not Path(folder).is_dir():
        raise KeysError(f"no allow-list folder {folder}")
    return set(zmq.auth.load_certificates(folder))


@dataclass(frozen=True)
class ServerKeys:
    """What the control plane loads from a key directory."""

    directory: Path
    pair: KeyPair
    workers: set[bytes]
    clients: set[bytes]

    @classmethod
    def load(cls, directory: str | Path) -> ServerKeys:
        root = Path(directory)
        keys = cls(
            root,
            load_pair(root / f"{CONTROL}.key_secret"),
            allowed_keys(root / WORKERS),
            allowed_keys(root / CLIENTS),
        )
        if not keys.workers:
            raise KeysError(f"{root / WORKERS} holds no worker public key (*.key)")
        if keys.workers & keys.clients:
            raise KeysError("a key is on both allow-lists: worker and client keys must differ")
        return keys


@dataclass(frozen=True)
class PeerKeys:
    """What a worker or a client loads: the control plane's public key and its own pair."""

    server: bytes
    pair: KeyPair

    @classmethod
    def load(cls, directory: str | Path, role: str, name: str) -> PeerKeys:
        root = Path(directory)
        return cls(
            load_public(root / f"{CONTROL}.key"), load_pair(root / role / f"{name}.key_secret")
        )

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the control plane (before it connects)."""
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.pair.public
        sock.curve_secretkey = self.pair.secret


def serve_curve(sock: zmq.Socket, pair: KeyPair, domain: str) -> None:
    """Make `sock` a CURVE server whose peers the ZAP handler checks in `domain` (before bind)."""
    sock.curve_server = True
    sock.curve_publickey = pair.public
    sock.curve_secretkey = pair.secret
    sock.zap_domain = domain.encode()


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """libzmq's ZAP handler for `ctx`: the worker port's domain admits only worker keys, the
    client port's only client keys and the control planes' own (another plane forwarding a
    request). A peer's authenticated key is its frames' User-Id."""
    auth = ThreadAuthenticator(ctx, log=_QuietLog())
    auth.start()
    auth.configure_curve(domain=WORKERS, location=keys.directory / WORKERS)
    auth.configure_curve(domain=CLIENTS, location=keys.directory / CLIENTS)
    # Control planes forward requests to each other as clients, under the service's own key.
    auth.certs[CLIENTS][keys.pair.public] = True
    return auth


def is_loopback(endpoint: str) -> bool:
    """An endpoint only this machine can reach: ipc://, inproc:// or tcp on a loopback host."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


class _QuietLog:
    """pyzmq's authenticator logs every handshake at debug; specserve logs refusals itself."""

    def debug(self, *args: object, **kwargs: object) -> None:
        pass

    info = debug

    def warning(self, *args: object, **kwargs: object) -> None:
        pass

    error = warning
    exception = warning


def peer_keys(keys: PeerKeys | str | os.PathLike | None, role: str, name: str) -> PeerKeys | None:
    """`keys` as given to a client or worker: loaded PeerKeys, a key directory, or None."""
    if keys is None or isinstance(keys, PeerKeys):
        return keys
    return PeerKeys.load(keys, role, name)


def default_keys_dir() -> Path:
    """Where `specserve up` keeps the keys of its local service: `$SPECSERVE_CACHE_DIR/keys`."""
    return cache_root() / "keys"


def ensure_keys(directory: str | Path) -> bool:
    """Generate a key directory unless it already holds the control plane's pair; True when
    keys were generated."""
    if (Path(directory) / f"{CONTROL}.key_secret").exists():
        return False
    generate_keys(directory)
    return True
