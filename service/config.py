"""Settings, read from ``CRYPTD_*`` environment variables. Weak configurations are refused
outside development.

Over 400 lines because it is one declaration: every setting with its default, its bounds and
a line saying why, and the checks that must see them together (what production refuses), so
an operator's question "what does this variable do" has one place to look."""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.cpus import available_cpus
from service.defaults import (
    APPROVAL_OPERATIONS,
    DEFAULT_APPROVAL_TTL,
    DEFAULT_BUDGET,
    DEFAULT_MAX_SKEW,
    DEFAULT_SHARE,
    MAX_APPROVAL_TTL,
    MAX_DELETION_WAITING_PERIOD,
    MIN_APPROVAL_TTL,
    ExecutorKind,
    default_usage_file,
)

# Where a key type's work runs: an executor kind, or "mixed": one item on the event loop,
# a batch in the thread pool. "sliced" runs every item on the event loop, one at a time and
# CRYPTD_SLICE_SHARE of the time while other requests are in progress, else at most
# CRYPTD_SLICE_BUDGET seconds of them per loop iteration (service/pool/sliced.py).
Placement = Literal["inline", "sliced", "thread", "process", "mixed"]

# Measured defaults (docs/EXECUTORS.md): AEAD, ECDSA-P256, Ed25519 and HMAC cost microseconds,
# less than a hand-off to a thread (13-28 us), so they run on the event loop. An RSA-2048, SM2
# or P-384 item costs 0.25-0.5 ms: on the loop ("mixed") it saves the hand-off and is the
# fastest for that traffic alone, but every cheap request behind it waits (mixed traffic: AES
# at ~5x its P99 alone). RSA-2048 is "sliced": on the loop, yielding to the cheap requests,
# measured best on the mix of AES and RSA-2048 (the RSA stream 0.94x -> 1.36x OpenBao's in
# the thread pool's stead, the AES stream's P99 3.2 -> 2.2x its P99 alone with the share)
# and for RSA alone. SM2 (~0.3 ms an
# item, RSA-2048's range) is "sliced" too: server CPU per signature 434 against 583 us in the
# thread pool, and beside AES 2,011 against 1,066 signatures/s (the AES stream's P99 3.7 ->
# 5.6 ms, the RSA trade). P-384 goes to the thread pool, whose results come back within
# CRYPTD_GIL_SWITCH_INTERVAL (0.5 ms) instead of Python's 5 ms. RSA-3072/4096 and P-521 items
# (1-2.5 ms, as long as a slice) run in the thread pool too.
DEFAULT_EXECUTORS: dict[str, Placement] = {
    "aes256-gcm": "inline",
    "sm4-gcm": "inline",
    "rsa-2048": "sliced",
    "rsa-3072": "thread",
    "rsa-4096": "thread",
    "ecdsa-p256": "inline",
    "ed25519": "inline",
    "sm2": "sliced",
    "hmac-sha256": "inline",
    "hmac-sha512": "inline",
    "hmac-sm3": "inline",
    "ecdsa-p384": "thread",  # sign 0.44 ms, verify 0.55 ms (RSA-2048's range)
    "ecdsa-p521": "thread",  # verify 1.1 ms (RSA-3072's range)
    # ML-DSA releases the GIL (a Python loop kept 63% of its pace beside a signing thread on
    # this 2-core host) and signs in 0.7 ms (44) to 1.7-2.7 ms (65, 87): the thread pool.
    "ml-dsa-44": "thread",
    "ml-dsa-65": "thread",
    "ml-dsa-87": "thread",
    # HPKE with ML-KEM costs 60-110 us an item (ECDSA-P256's range): on the loop. X-Wing adds
    # an X25519 exchange (160-220 us, below RSA-2048's 0.25-0.5 ms): sliced, as RSA-2048.
    "ml-kem-768": "inline",
    "ml-kem-1024": "inline",
    "x25519-ml-kem-768": "sliced",
    # Composites: an ML-DSA-65 signature (1.7 ms) plus a traditional one: ML-DSA's pool.
    "ml-dsa-65-ecdsa-p256": "thread",
    "ml-dsa-65-ed25519": "thread",
    "ml-dsa-65-sm2": "thread",
}


DEFAULT_DELETION_WAITING_PERIOD = 7 * 86400  # AWS KMS's shortest waiting period


class SettingsProblems(ValueError):
    """Every missing, conflicting or weak setting found at once, one sentence each saying what
    to set."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def settings_problems(exc: ValidationError) -> list[str]:
    """``exc`` (from ``Settings()``) as plain sentences: a field's error names its variable,
    a validator's is its own text (without pydantic's "Value error," prefix). The input, which
    may be a secret, is never quoted. pydantic checks the settings as a whole only once every
    field is valid: when some are not, the whole is checked again with those fields at their
    defaults, so that the missing and conflicting settings are reported in the same run."""
    found = _problems_of(exc)
    invalid = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
    if invalid:
        defaults = {
            name: Settings.model_fields[name].get_default(call_default_factory=True)
            for name in invalid
            if name in Settings.model_fields
        }
        try:
            Settings(**defaults)
        except ValidationError as again:
            found.extend(p for p in _problems_of(again) if p not in found)
    return found


def _problems_of(exc: ValidationError) -> list[str]:
    found: list[str] = []
    for error in exc.errors(include_url=False, include_input=False):
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, SettingsProblems):
            found.extend(cause.problems)
            continue
        message = str(cause) if isinstance(cause, ValueError) else error["msg"]
        field, *rest = [str(part) for part in error["loc"]] or [""]
        if field:
            name = "CRYPTD_" + field.upper() + "".join(f"[{part}]" for part in rest)
            if not message.startswith(name):
                message = f"{name}: {message}"
        found.append(message)
    return found


SealKind = Literal["static", "pkcs11", "shamir", "transit"]


class SealSettings(BaseSettings):
    """What finds the master key (service/seal/): enough for the CLI's operator commands,
    which run without the server's other settings."""

    model_config = SettingsConfigDict(env_prefix="CRYPTD_", extra="ignore")

    env: Literal["production", "development"] = "production"
    # static: the key itself in CRYPTD_MASTER_KEY(_FILE); pkcs11: only wrapped, by a token key;
    # shamir: only as shares held by operators (the server starts sealed); transit: only wrapped,
    # by a key of an OpenBao/Vault Transit engine or of another cryptd (auto-unseal).
    seal: SealKind = "static"
    master_key: SecretStr | None = None
    master_key_file: Path | None = None
    keyring_file: Path = Path("keyring.json")
    pkcs11_module: Path | None = None
    pkcs11_token_label: str | None = None
    pkcs11_key_label: str = "cryptd-seal"
    pkcs11_pin_file: Path | None = None
    # transit (service/seal/transit.py): OpenBao/Vault with an address and a token file, or
    # another cryptd with a client credential file (its URL unless the address overrides it).
    transit_address: str | None = None
    transit_key: str = "cryptd-seal"
    transit_mount: str = "transit"
    transit_token_file: Path | None = None
    transit_credential_file: Path | None = None
    transit_ca_file: Path | None = None
    transit_timeout: float = Field(default=5.0, gt=0, le=120)
    # The sealed master key (pkcs11: not secret without the token) or the Shamir split's public
    # facts (shamir): beside the keyring file unless set.
    sealed_master_key_file: Path | None = None

    def sealed_master_key_path(self) -> Path:
        return self.sealed_master_key_file or self.keyring_file.with_name("sealed-master-key.json")

    @model_validator(mode="after")
    def _seal_consistent(self) -> SealSettings:
        # Settings reports these with its other problems, all at once (_refuse_weak).
        if type(self) is SealSettings and (problems := self._seal_problems()):
            raise SettingsProblems(problems)
        return self

    def _seal_problems(self) -> list[str]:
        if self.seal == "static":
            return []
        if self.master_key is not None or self.master_key_file is not None:
            return [
                f"CRYPTD_SEAL={self.seal} keeps the master key sealed: unset CRYPTD_MASTER_KEY "
                "and CRYPTD_MASTER_KEY_FILE (the key must not be in the environment or on disk)"
            ]
        if self.seal == "shamir":
            return []
        if self.seal == "transit":
            return self._transit_problems()
        missing = [
            name
            for name, value in (
                ("CRYPTD_PKCS11_MODULE", self.pkcs11_module),
                ("CRYPTD_PKCS11_TOKEN_LABEL", self.pkcs11_token_label),
                ("CRYPTD_PKCS11_PIN_FILE", self.pkcs11_pin_file),
            )
            if not value
        ]
        if missing:
            return [f"CRYPTD_SEAL=pkcs11 needs {', '.join(missing)}"]
        return []

    def _transit_problems(self) -> list[str]:
        peer, bao = self.transit_credential_file, self.transit_token_file
        if peer is not None and bao is not None:
            return [
                "CRYPTD_SEAL=transit: set CRYPTD_TRANSIT_TOKEN_FILE (OpenBao/Vault) or "
                "CRYPTD_TRANSIT_CREDENTIAL_FILE (another cryptd), not both"
            ]
        if peer is None and bao is None:
            return [
                "CRYPTD_SEAL=transit needs CRYPTD_TRANSIT_ADDRESS and CRYPTD_TRANSIT_TOKEN_FILE "
                "(OpenBao/Vault), or CRYPTD_TRANSIT_CREDENTIAL_FILE (another cryptd)"
            ]
        if bao is not None and not self.transit_address:
            return [
                "CRYPTD_SEAL=transit with CRYPTD_TRANSIT_TOKEN_FILE needs CRYPTD_TRANSIT_ADDRESS"
            ]
        if self.transit_address and not self.transit_address.startswith(("http://", "https://")):
            return [f"CRYPTD_TRANSIT_ADDRESS {self.transit_address!r}: an http(s):// URL"]
        return []

    def load_master_key(self) -> bytes:
        """Return the 32-byte master key from the variable or the file; refuse anything else."""
        if self.master_key is not None:
            raw = self.master_key.get_secret_value()
            source = "CRYPTD_MASTER_KEY"
        elif self.master_key_file is not None:
            raw = self.master_key_file.read_text().strip()
            source = "CRYPTD_MASTER_KEY_FILE"
        else:
            raise ValueError("no master key configured")
        return decode_master_key(raw, source)


class Settings(SealSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    workers: int = Field(default=0, ge=0, le=256)  # 0: one per CPU available (service/cpus.py)
    worker_index: int = Field(default=0, ge=0)  # set by the supervisor in each worker process

    # PostgreSQL key store shared by replicas (postgresql://...; libpq parameters such as
    # sslmode pass through). Unset: the keyring file.
    keystore_url: SecretStr | None = None
    # The deployment id the key store must carry (`cryptd keystore show` prints it); unset:
    # whatever the store holds at start, and never another one while running.
    keystore_id: str | None = None
    # Seconds between looks for keys whose automatic rotation or destruction is due.
    auto_rotate_check_interval: float = Field(default=10.0, gt=0)
    # Seconds between DELETE and the destruction of the key (pending_deletion meanwhile,
    # cancel-deletion undoes it); 0: deleted at once. Unset: 7 days, 0 in development.
    deletion_waiting_period: int | None = Field(default=None, ge=0, le=MAX_DELETION_WAITING_PERIOD)
    keyring_reload_interval: float = Field(default=1.0, gt=0)
    # Where this host's server workers share state without a server (the generation board of
    # service/keys/board.py): cryptd serve makes a private one when unset.
    runtime_dir: Path | None = None
    # How long the answer to a key change waits for the other replicas to enforce it
    # (service/keys/propagation.py); the answer says which ones did. The default outlasts a
    # silent replica's lease (service/keys/lease.py): an answer never leaves while a replica
    # may still serve what the change took away.
    propagation_timeout: float = Field(default=7.0, ge=0, le=60)
    keyring_read_only: bool = False
    # Seconds a new key version waits before encryptions and signatures use it, so that every
    # replica has reloaded it first (Kubernetes: longer than the kubelet's Secret sync period).
    key_activation_delay: float = Field(default=0.0, ge=0)

    clients_file: Path | None = None
    signature_max_age: int = Field(default=300, ge=1, le=3600)
    # How far ahead of this server's clock a signature's created may be; also how long a
    # replay store that starts empty refuses what was signed before it (docs/AUTH.md).
    signature_max_skew: int = Field(default=DEFAULT_MAX_SKEW, ge=1, le=300)
    redis_url: str | None = None
    # The host-local replay store every server worker shares (cryptd serve sets it when
    # neither it nor CRYPTD_REDIS_URL is given); with Redis configured, Redis is the store.
    replay_dir: Path | None = None
    replay_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    replay_fail_open: bool = False
    rate_limit_per_second: float = Field(default=0.0, ge=0)
    rate_limit_burst: int = Field(default=0, ge=0)

    # TLS (service/edge/tls.py): required outside development unless CRYPTD_TLS=off, set on
    # purpose where a proxy or mesh sidecar terminates TLS in front of cryptd.
    tls: Literal["on", "off"] | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None  # mutual TLS: client certificates from this CA
    tls_client_cert: Literal["required", "optional"] = "required"

    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    # The HTTP edge (service/edge/protocol.py): request line and header fields together; the
    # head due within header_read_timeout of a request's first byte (or of the connection's
    # opening), the whole request within request_read_timeout; idle keep-alive connections
    # closed after keepalive_timeout.
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1024 * 1024)
    header_read_timeout: float = Field(default=5.0, gt=0, le=300)
    request_read_timeout: float = Field(default=30.0, gt=0, le=3600)
    keepalive_timeout: int = Field(default=5, ge=1, le=3600)
    max_batch_items: int = Field(default=1000, ge=1)
    # Per key type, in place of the limit derived from service/batchcost.py's cost table.
    max_batch_items_by_type: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)

    pool_workers: int = Field(default=0, ge=0)  # 0: cores / server workers (docs/EXECUTORS.md)
    pool_max_pending: int = Field(default=2048, ge=1)
    pool_deadline: float = Field(default=5.0, gt=0)
    # Event-loop lag beyond which crypto requests get 503 at once (service/pool/lag.py).
    max_loop_lag: float = Field(default=0.25, gt=0)
    pool_chunk_size: int = Field(default=64, ge=1)
    # How long a thread waiting for the GIL lets the holder run first (sys.setswitchinterval).
    # A crypto thread that finishes a signature waits up to this long for the busy event loop
    # to hand the GIL back (Python's default: 5 ms; docs/EXECUTORS.md, mixed traffic).
    gil_switch_interval: float = Field(default=0.0005, gt=0, le=0.1)
    executors: dict[str, Placement] = Field(default_factory=lambda: dict(DEFAULT_EXECUTORS))
    # The sliced placement's share of the time while other crypto requests are in progress,
    # and its seconds of work per event-loop iteration while none is (docs/EXECUTORS.md).
    slice_share: float = Field(default=DEFAULT_SHARE, gt=0, lt=1.0)
    slice_budget: float = Field(default=DEFAULT_BUDGET, gt=0, le=1.0)

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = False
    audit_log: str = "stderr"  # "stderr", "off" or a file path (the chained audit trail)
    # A request whose audit record cannot be made durable is refused 503 audit_unavailable
    # (None: on in production); only with a file audit_log.
    audit_fail_closed: bool | None = None
    # A signed checkpoint after this many records, or this many seconds after the first
    # record it would cover; a rotation when the file passes audit_max_bytes (0: size never).
    audit_checkpoint_records: int = Field(default=1000, ge=1, le=1_000_000)
    audit_checkpoint_interval: float = Field(default=10.0, gt=0, le=3600)
    audit_max_bytes: int = Field(default=0, ge=0)
    # How long a record may wait for the requests still running on its worker to join its
    # fdatasync (group commit, as PostgreSQL's commit_delay); 0: sync at once.
    audit_group_delay_ms: float = Field(default=1.0, ge=0, le=1000)
    audit_hmac_key_names: bool = False  # key names as HMACs too (the salt is the deployment's)
    # The checkpoint signing key's type when the service makes it (an existing key keeps its).
    audit_signing_key_type: Literal["ed25519", "sm2"] = "ed25519"
    audit_syslog: str | None = None  # "host:port": RFC 5424 over TCP, a second copy
    metrics: bool = True
    # Keys labelled in cryptd_key_operations_total; later keys count as key="_other".
    metrics_max_keys: int = Field(default=100, ge=0, le=100_000)
    # Key usage counts (service/usage/): seconds between flushes to the usage store, and that
    # store's file beside the keyring (file key store; PostgreSQL keeps them in its database).
    usage_flush_interval: float = Field(default=2.0, gt=0, le=3600)
    usage_file: Path | None = None
    # /openapi.json and /docs (unsigned): None = on in development, off in production.
    docs: bool | None = None

    # Dual control (docs/AUTH.md): comma-separated operations that wait for a second admin
    # client, and the seconds from the request to the last moment it may be carried out.
    approvals: str = ""
    approval_ttl: int = Field(
        default=DEFAULT_APPROVAL_TTL, ge=MIN_APPROVAL_TTL, le=MAX_APPROVAL_TTL
    )

    dev_dir: Path = Path(".cryptd-dev")

    @field_validator("approvals", mode="after")
    @classmethod
    def _approval_names(cls, value: str) -> str:
        names = [part.strip() for part in value.split(",") if part.strip()]
        unknown = [name for name in names if name not in APPROVAL_OPERATIONS]
        if unknown:
            raise ValueError(
                f"unknown operation {unknown[0]!r} (known: {', '.join(APPROVAL_OPERATIONS)})"
            )
        return ",".join(dict.fromkeys(names))

    def approval_operations(self) -> frozenset[str]:
        return frozenset(filter(None, self.approvals.split(",")))

    @field_validator("keystore_url", mode="after")
    @classmethod
    def _postgres_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if not value.get_secret_value().startswith(("postgresql://", "postgres://")):
            raise ValueError("CRYPTD_KEYSTORE_URL must be a postgresql:// URL")
        return value

    def usage_file_path(self) -> Path:
        """Where the file key store's usage counts live: beside the keyring by default."""
        return self.usage_file or default_usage_file(self.keyring_file)

    def keystore_url_value(self) -> str | None:
        return None if self.keystore_url is None else self.keystore_url.get_secret_value()

    @field_validator("max_batch_items_by_type", mode="after")
    @classmethod
    def _known_types(cls, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(value) - set(DEFAULT_EXECUTORS))
        if unknown:
            raise ValueError(f"unknown key type(s) {unknown}; known: {sorted(DEFAULT_EXECUTORS)}")
        return value

    @field_validator("executors", mode="after")
    @classmethod
    def _merge_executors(cls, value: dict[str, Placement]) -> dict[str, Placement]:
        return {**DEFAULT_EXECUTORS, **value}

    def executor_kind(self, key_type: str) -> ExecutorKind:
        """The executor that runs ``key_type``'s batches (and its single items unless inline)."""
        placement = self.executors[key_type]
        return "thread" if placement == "mixed" else placement

    def deletion_waiting_period_value(self) -> int:
        if self.deletion_waiting_period is not None:
            return self.deletion_waiting_period
        return 0 if self.env == "development" else DEFAULT_DELETION_WAITING_PERIOD

    def audit_fail_closed_value(self) -> bool:
        if self.audit_fail_closed is not None:
            return self.audit_fail_closed
        return self.env == "production"

    def audit_syslog_address(self) -> tuple[str, int] | None:
        if not self.audit_syslog:
            return None
        host, _, port = self.audit_syslog.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("CRYPTD_AUDIT_SYSLOG must be host:port")
        return host.strip("[]"), int(port)

    def docs_enabled(self) -> bool:
        return self.env == "development" if self.docs is None else self.docs

    def single_items_inline(self) -> frozenset[str]:
        """Key types whose single items run on the event loop whatever their executor."""
        return frozenset(name for name, where in self.executors.items() if where == "mixed")

    @model_validator(mode="after")
    def _size_pool(self) -> Settings:
        # One server worker per CPU this process may use (affinity, cgroup quota), and crypto
        # threads across all server workers = those CPUs: more only adds contention.
        cpus = available_cpus()
        if self.workers == 0:
            # Auto: one per CPU where the workers can share a replay store (cryptd serve always
            # gives them one); an app built in a process of its own is one worker.
            shared = self.redis_url is not None or self.replay_dir is not None
            self.workers = cpus if shared else 1
        if self.pool_workers == 0:
            self.pool_workers = max(1, cpus // self.workers)
        return self

    @model_validator(mode="after")
    def _refuse_weak(self) -> Settings:
        # Every problem at once: an operator learns all the settings to fix from one start.
        problems = [
            *self._seal_problems(),
            *self._replay_problems(),
            *self._production_problems(),
            *self._tls_problems(),
        ]
        if problems:
            raise SettingsProblems(problems)
        return self

    def _replay_problems(self) -> list[str]:
        # In development too: each worker's own memory would accept a replay once per worker.
        if self.workers > 1 and self.redis_url is None and self.replay_dir is None:
            return [
                f"CRYPTD_WORKERS={self.workers} needs a replay store every worker shares: "
                "set CRYPTD_REPLAY_DIR (cryptd serve does) or CRYPTD_REDIS_URL, or run one "
                "worker (CRYPTD_WORKERS=1)"
            ]
        return []

    def _production_problems(self) -> list[str]:
        if self.env == "development":
            return []
        problems = []
        if self.seal == "static" and self.master_key is None and self.master_key_file is None:
            problems.append(
                "no master key: set CRYPTD_MASTER_KEY_FILE to a file holding one (make it with "
                "`cryptd master-key generate --out master.key`), or CRYPTD_MASTER_KEY"
            )
        if self.clients_file is None:
            problems.append(
                "no API clients: set CRYPTD_CLIENTS_FILE to the clients file (make it with "
                "`cryptd clients add NAME --allow 'KEYS:OPERATIONS' --file clients.json`); "
                "required outside development"
            )
        if (url := self.keystore_url_value()) is not None and (weak := _weak_tls(url)):
            problems.append(
                f"CRYPTD_KEYSTORE_URL reaches {weak} without TLS verification: add "
                "sslmode=verify-full (and sslrootcert=...) to the URL, or sslmode=disable "
                "if the network itself is trusted (a service mesh)"
            )
        if self.replay_fail_open and self.redis_url is None:
            problems.append("CRYPTD_REPLAY_FAIL_OPEN only applies with CRYPTD_REDIS_URL: unset it")
        return problems

    def _tls_problems(self) -> list[str]:
        files = (self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        if self.tls == "off":
            if any(path is not None for path in files):
                return ["CRYPTD_TLS=off, yet CRYPTD_TLS_*_FILE are set: choose one"]
            return []
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            return ["CRYPTD_TLS_CERT_FILE and CRYPTD_TLS_KEY_FILE go together: set both"]
        if self.tls_cert_file is None:
            if self.tls_client_ca_file is not None:
                return [
                    "CRYPTD_TLS_CLIENT_CA_FILE (mutual TLS) needs CRYPTD_TLS_CERT_FILE and "
                    "CRYPTD_TLS_KEY_FILE"
                ]
            if self.tls == "on" or self.env != "development":
                return [
                    "TLS is required: set CRYPTD_TLS_CERT_FILE and CRYPTD_TLS_KEY_FILE "
                    "(docs/DEPLOY.md says how to make them), or CRYPTD_TLS=off on purpose "
                    "where a proxy or mesh sidecar in front of cryptd terminates TLS"
                ]
        return []


_LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1", "[::1]"})


def _weak_tls(url: str) -> str | None:
    """The remote host ``url`` reaches with libpq's opportunistic TLS (sslmode unset, allow,
    prefer: a man in the middle simply declines TLS), or None. Local hosts and Unix sockets
    are fine; an explicit sslmode (require, verify-ca, verify-full, or disable) is a choice."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    sslmode = (query.get("sslmode") or [os.environ.get("PGSSLMODE", "")])[-1]
    if sslmode in ("require", "verify-ca", "verify-full", "disable"):
        return None
    hosts = (query.get("host") or [parts.hostname or ""])[-1].split(",")
    remote = [h for h in hosts if h not in _LOCAL_HOSTS and not h.startswith("/")]
    return remote[0] if remote else None


def decode_master_key(text: str, source: str = "master key") -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{source} is not valid base64") from None
    if len(key) != 32:
        raise ValueError(f"{source} must decode to 32 bytes, got {len(key)}")
    if len(set(key)) < 8:
        raise ValueError(f"{source} has too little entropy")
    return key
