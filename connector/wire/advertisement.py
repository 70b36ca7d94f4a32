"""Wire types shared by engines (the vLLM plugin), the rendezvous and the router.

One `EngineAdvertisement` per engine: who it is, where to reach it, how it is laid out, and for decode the
pre-registered KV block metadata a prefill engine needs to WRITE without a lazy handshake. The rendezvous
keeps advertisements under a lease and streams changes to routers as `WatchEvent`s (newline-delimited JSON).

These models are the contract: the operator may import them, this module imports nothing from the operator.
Every model forbids unknown fields, so a typo in a client is a 4xx, not a silently dropped field. So a field added
later is optional with default None (what an older engine sends still parses), and every writer leaves out what is
None (`exclude_none`): what uses no new field is also what an older rendezvous or router accepts, which a rolling
upgrade or a rollback of the operator needs.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

Role = Literal["prefill", "decode"]
KvMode = Literal["push", "pull"]

ENGINE_ID_MAX = 320  # a pod name (DNS subdomain, <= 253) + "-" + a UID (36), with room to spare
# The launch script accepts the same characters; no "/" so an id is always one URL path segment.
ENGINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_ENGINE_ID_RE = re.compile(ENGINE_ID_PATTERN)
_TOKEN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
MAX_KV_METADATA_BYTES = 4 * 1024 * 1024
"""Upper bound of `kv_metadata`: the base64 text itself, or a dict's compact JSON encoding."""
MIN_LEASE_SECONDS = 0.1
MAX_LEASE_SECONDS = 3600.0
MAX_PARALLEL = 1024

Port = Annotated[int, Field(ge=1, le=65535)]


def _check_token(value: str, what: str, max_len: int = 253) -> str:
    if not value:
        raise ValueError(f"{what} must not be empty")
    if len(value) > max_len:
        raise ValueError(f"{what} is longer than {max_len} characters")
    if not _TOKEN_RE.match(value):
        raise ValueError(f"{what} {value!r} may only contain letters, digits, '.', '_', ':' and '-', "
                         "starting with a letter or digit")
    return value


def check_engine_id(value: str) -> str:
    """Raise ValueError unless `value` is a valid engine id (also used for the URL path parameter)."""
    if not value:
        raise ValueError("engine_id must not be empty")
    if len(value) > ENGINE_ID_MAX:
        raise ValueError(f"engine_id is longer than {ENGINE_ID_MAX} characters")
    if not _ENGINE_ID_RE.match(value):
        raise ValueError(f"engine_id {value!r} may only contain letters, digits, '.', '_' and '-', starting with "
                         "a letter or digit")
    return value


def check_tcp_endpoint(value: str, what: str) -> str:
    """Raise ValueError unless `value` is a ZMQ TCP endpoint to connect to: `tcp://host:port`, an IPv6 host in
    brackets, a port from 1 to 65535, nothing else."""
    if len(value) > 300:
        raise ValueError(f"{what}: {value[:40]!r}... is longer than 300 characters")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{what}: {value!r} is not tcp://host:port: {e}") from None
    if parts.scheme != "tcp" or not parts.hostname or port is None or port == 0 or "*" in value:
        raise ValueError(f"{what}: {value!r} is not tcp://host:port (a host to connect to, a port from 1 to 65535)")
    if parts.path or parts.query or parts.fragment or parts.username or parts.password \
            or any(c.isspace() for c in value):
        raise ValueError(f"{what}: {value!r} must be tcp://host:port only")
    return value


def _field_name(info: ValidationInfo) -> str:
    """The validated field's name (pydantic sets it for every field validator; None only in model validators)."""
    assert info.field_name is not None
    return info.field_name


class WireModel(BaseModel):
    # strict: "8" is not a TP size and true is not 1; a wire protocol should not guess.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class EngineAdvertisement(WireModel):
    """One engine's record in the rendezvous. Engines PUT it on start and renew it every heartbeat."""

    role: Role
    """`prefill` or `decode`."""
    engine_id: str
    """The vLLM `engine_id` of `--kv-transfer-config` (`$DISAGG_ENGINE_ID`: pod name + UID). Unique per engine
    incarnation; letters, digits, '.', '_', '-'."""
    deployment: str
    """The DisaggregatedInference this engine belongs to (`$DISAGG_DEPLOYMENT`)."""
    pod_name: str | None = None
    """The engine's pod (`$POD_NAME`); None outside Kubernetes. Checked against the token's pod in
    `--auth kubernetes`. At most one advertisement per pod: a new engine id from the same pod replaces the old."""
    pod_uid: str | None = None
    """The pod's UID (`$POD_UID`); None outside Kubernetes. An engine id already held by another UID is a
    conflict (409)."""
    http_url: str
    """Base URL of the engine's OpenAI-compatible server, e.g. `http://10.0.0.5:8000` (http or https, no path)."""
    side_channel_host: str
    """NIXL side-channel host (`$VLLM_NIXL_SIDE_CHANNEL_HOST`), the `remote_host` of push params."""
    side_channel_ports: list[Port] = Field(min_length=1, max_length=MAX_PARALLEL)
    """NIXL side-channel ports, one per data-parallel rank (index = DP rank); `remote_port` is the first."""
    tp_size: int = Field(ge=1, le=MAX_PARALLEL)
    """Tensor-parallel size (the `tp_size` of push params)."""
    pp_size: int = Field(default=1, ge=1, le=MAX_PARALLEL)
    """Pipeline-parallel size."""
    dp_size: int = Field(default=1, ge=1, le=MAX_PARALLEL)
    """Data-parallel size; must equal the number of side-channel ports."""
    block_size: int = Field(ge=1, le=1 << 20)
    """KV-cache block size in tokens."""
    layout_key: str
    """`$DISAGG_LAYOUT_KEY`: the router only pairs engines with equal keys (model, dtype, block size, mode,
    image), so engines of two generations are never paired during a rollout."""
    kv_mode: KvMode
    """`push` or `pull`: from the connector class the engine runs (NixlPushConnector is push)."""
    transport: str | None = None
    """The NIXL backend actually instantiated (e.g. `UCX`, `LIBFABRIC`); None until known."""
    kv_metadata: str | dict[str, Any] | None = None
    """Decode only: its pre-registered KV block metadata, opaque to the rendezvous and the router. Either a
    base64 string or a JSON object, at most 4 MiB encoded."""
    lease_seconds: float = Field(default=15.0, ge=MIN_LEASE_SECONDS, le=MAX_LEASE_SECONDS, allow_inf_nan=False)
    """How long the entry lives without a renewal. Engines renew every heartbeat and ask for three heartbeats."""
    kv_events_endpoints: list[str] | None = Field(default=None, min_length=1, max_length=MAX_PARALLEL)
    """Where to subscribe (ZMQ SUB) to the engine's KV cache events, vLLM's `--kv-events-config` publisher, one
    `tcp://host:port` per data-parallel rank (index = DP rank); the framing is connector/wire/kv_events.py. None when
    the engine publishes none, and from engines older than the field (the rendezvous and routers take both)."""
    kv_events_replay_endpoints: list[str] | None = Field(default=None, min_length=1, max_length=MAX_PARALLEL)
    """Where to ask (ZMQ DEALER) for the batches a subscriber missed, one `tcp://host:port` per data-parallel rank.
    None when the engine keeps no replay buffer; only with `kv_events_endpoints`."""

    @field_validator("engine_id")
    @classmethod
    def _engine_id(cls, v: str) -> str:
        return check_engine_id(v)

    @field_validator("deployment", "layout_key")
    @classmethod
    def _names(cls, v: str, info: ValidationInfo) -> str:
        return _check_token(v, _field_name(info))

    @field_validator("pod_name", "pod_uid", "transport")
    @classmethod
    def _optional_names(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else _check_token(v, _field_name(info))

    @field_validator("side_channel_host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v or len(v) > 253 or any(c.isspace() or c in "/?#@" for c in v):
            raise ValueError(f"side_channel_host {v!r} is not a host name or IP address")
        return v

    @field_validator("http_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if len(v) > 2048:
            raise ValueError("http_url is longer than 2048 characters")
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as e:
            raise ValueError(f"http_url {v!r} is not a URL: {e}") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"http_url {v!r} must use http or https")
        if not parts.hostname:
            raise ValueError(f"http_url {v!r} has no host")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"http_url {v!r} must be scheme://host[:port] only (no path, query or credentials)")
        return v.rstrip("/")

    @field_validator("kv_events_endpoints", "kv_events_replay_endpoints")
    @classmethod
    def _zmq_endpoints(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        return None if v is None else [check_tcp_endpoint(e, _field_name(info)) for e in v]

    @field_validator("kv_metadata")
    @classmethod
    def _kv_metadata(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is None:
            return v
        if isinstance(v, str):
            if len(v) > MAX_KV_METADATA_BYTES:
                raise ValueError(f"kv_metadata is {len(v)} bytes, more than {MAX_KV_METADATA_BYTES}")
            try:
                base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("kv_metadata string is not valid base64") from None
            return v
        size = len(json.dumps(v, separators=(",", ":")))
        if size > MAX_KV_METADATA_BYTES:
            raise ValueError(f"kv_metadata is {size} bytes as JSON, more than {MAX_KV_METADATA_BYTES}")
        return v

    @model_validator(mode="after")
    def _dp_ports(self) -> EngineAdvertisement:
        if len(self.side_channel_ports) != self.dp_size:
            raise ValueError(f"side_channel_ports has {len(self.side_channel_ports)} ports but dp_size is "
                             f"{self.dp_size}: one port per data-parallel rank")
        for name in ("kv_events_endpoints", "kv_events_replay_endpoints"):
            endpoints = getattr(self, name)
            if endpoints is not None and len(endpoints) != self.dp_size:
                raise ValueError(f"{name} has {len(endpoints)} endpoints but dp_size is {self.dp_size}: one "
                                 "endpoint per data-parallel rank")
        if self.kv_events_replay_endpoints is not None and self.kv_events_endpoints is None:
            raise ValueError("kv_events_replay_endpoints without kv_events_endpoints: a replay fills gaps in a "
                             "stream the engine must advertise too")
        return self

    @property
    def side_channel_port(self) -> int:
        """DP rank 0's side-channel port: the `remote_port` of push-mode kv_transfer_params."""
        return self.side_channel_ports[0]


EventType = Literal["ADDED", "MODIFIED", "DELETED", "EXPIRED", "RESET", "BOOKMARK"]
ENGINE_EVENTS = frozenset({"ADDED", "MODIFIED", "DELETED", "EXPIRED"})


class WatchEvent(WireModel):
    """One line of `GET /v1/watch` (and one change in the registry's log).

    - `ADDED`, `MODIFIED`: `engine` is the new advertisement; `DELETED` (deregistered, or replaced by a newer
      engine of the same pod) and `EXPIRED` (lease ran out): `engine` is the last advertisement.
    - `RESET`: a snapshot follows: `ADDED` for every current engine, all at this version, then a `BOOKMARK`.
      Sent when the watch starts without `since`, when `since` is older than the log keeps, or from another
      `epoch` (the rendezvous restarted). Engines the client knows but the snapshot lacks are gone, unless
      `warming` is true: then the rendezvous restarted recently and may not have every renewal yet.
    - `BOOKMARK`: nothing changed up to `version`; sent after the initial batch and at least every heartbeat,
      so a client that sees no line for ~3 heartbeats knows the connection is dead.
    """

    version: int = Field(ge=0)
    """Registry version after this event; resume with `?since=<version>`."""
    type: EventType
    engine: EngineAdvertisement | None = None
    """The engine for ADDED/MODIFIED/DELETED/EXPIRED; absent for RESET and BOOKMARK."""
    epoch: str | None = None
    """RESET and BOOKMARK: the rendezvous instance; versions are only comparable within one epoch."""
    warming: bool | None = None
    """RESET and BOOKMARK: true while the rendezvous is younger than its warm-up (2 heartbeats), i.e. live
    engines may not have renewed yet, so an engine missing from the snapshot is not proof it is gone."""

    @model_validator(mode="after")
    def _engine_matches_type(self) -> WatchEvent:
        if (self.type in ENGINE_EVENTS) != (self.engine is not None):
            raise ValueError(f"{self.type} events {'need' if self.type in ENGINE_EVENTS else 'take no'} engine")
        return self


class EngineList(WireModel):
    """`GET /v1/engines`: the current engines (optionally filtered) at one version."""

    version: int = Field(ge=0)
    epoch: str
    warming: bool
    engines: list[EngineAdvertisement]


RegisterResult = Literal["created", "modified", "renewed"]


class RegisterResponse(WireModel):
    """Answer to `PUT /v1/engines/{id}` (201 created, 200 otherwise) and `POST /v1/engines/{id}/renew`."""

    version: int = Field(ge=0)
    """Registry version after the call (a pure renewal changes nothing and does not bump it)."""
    result: RegisterResult
    """`created` (ADDED event), `modified` (content changed: MODIFIED event), `renewed` (lease only)."""
    engine: EngineAdvertisement
    expires_in: float = Field(allow_inf_nan=False)
    """Seconds until the lease ends without another renewal."""


class ErrorResponse(WireModel):
    """Every 4xx/5xx body of the rendezvous."""

    error: str
    """Human-readable: names the problem (and, for schema errors, the field path)."""
    reason: str
    """Machine-readable: invalid_json, invalid_body, id_mismatch, bad_parameter, too_large, unauthenticated,
    forbidden, conflict, not_found, registry_full, auth_unavailable, not_allowed."""
    details: list[dict[str, Any]] | None = None
