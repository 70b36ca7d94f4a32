"""Who may write to the rendezvous: nobody checked (`none`), a shared token (`token`), or a pod-bound
ServiceAccount token verified with a TokenReview (`kubernetes`), which also ties an advertisement to its pod."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..wire import env as wire_env
from ..wire.advertisement import EngineAdvertisement
from .errors import HttpError, forbidden, unauthenticated

log = logging.getLogger("disagg.rendezvous")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"


@dataclass(frozen=True)
class Identity:
    """Who sent a write. Pod fields are set only by the Kubernetes authenticator (from the token's claims)."""

    subject: str
    pod_name: str | None = None
    pod_uid: str | None = None


def bearer_token(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise unauthenticated("missing Authorization: Bearer <token> header (writes need a token)")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthenticated("Authorization header must be 'Bearer <token>'")
    return token.strip()


class Authenticator:
    mode = "base"

    async def authenticate(self, request: web.Request) -> Identity:
        raise NotImplementedError

    def authorize_advertisement(self, identity: Identity, adv: EngineAdvertisement) -> None:
        """Raise 403 unless `identity` may publish `adv`."""

    def authorize_entry(self, identity: Identity, stored: EngineAdvertisement) -> None:
        """Raise 403 unless `identity` may renew or delete the stored entry."""

    async def close(self) -> None:
        pass


class NoAuth(Authenticator):
    """Anyone may write. Only when chosen explicitly (`--auth none`, e.g. for benchmarks)."""

    mode = "none"

    async def authenticate(self, request: web.Request) -> Identity:
        return Identity("anonymous")


class TokenAuth(Authenticator):
    """One shared secret for every writer (local runs)."""

    mode = "token"

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError(f"--auth token needs a non-empty token (--token or ${wire_env.RENDEZVOUS_TOKEN})")
        self._token = token.encode()

    async def authenticate(self, request: web.Request) -> Identity:
        if not hmac.compare_digest(bearer_token(request).encode(), self._token):
            raise unauthenticated("invalid token")
        return Identity("token")


TokenReviewer = Callable[[str, list[str] | None], Awaitable[dict[str, Any]]]
"""(token, audiences) -> TokenReview status as a dict: authenticated, user{username, extra}, audiences, error."""


def lightkube_reviewer(
        kubeconfig: str | os.PathLike[str] | None = None) -> tuple[TokenReviewer, Callable[[], Awaitable[None]]]:
    """A TokenReviewer posting authentication.k8s.io/v1 TokenReviews with lightkube's AsyncClient (in-cluster
    config, else `kubeconfig`, else $KUBECONFIG), and a coroutine that closes the client."""
    state: dict[str, Any] = {}

    def client() -> Any:  # lightkube.AsyncClient, imported only when a review is made
        if "client" not in state:
            from lightkube import AsyncClient, KubeConfig

            config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
            state["client"] = AsyncClient(config)
        return state["client"]

    async def review(token: str, audiences: list[str] | None) -> dict[str, Any]:
        from lightkube.models.authentication_v1 import TokenReviewSpec
        from lightkube.resources.authentication_v1 import TokenReview

        result = await client().create(TokenReview(spec=TokenReviewSpec(token=token, audiences=audiences)))
        return result.status.to_dict() if result.status is not None else {}

    async def close() -> None:
        if "client" in state:
            await state.pop("client").close()

    return review, close


def pod_name_pattern(deployment: str) -> re.Pattern[str]:
    """Pods of a deployment's engine StatefulSets: <deployment>-<role>-<revision>-<ordinal>, or, from an operator
    release before revisions, <deployment>-<role>-<ordinal> (or -<group>-<worker>)."""
    return re.compile(rf"^{re.escape(deployment)}-(?P<role>prefill|decode)(-[0-9a-f]{{{wire_env.REVISION_CHARS}}})?"
                      rf"-\d+(-\d+)?$")


class KubernetesAuth(Authenticator):
    """A pod-bound ServiceAccount token, verified with a TokenReview.

    Accepted when: the review says authenticated (for `audience`, if set); the user is a ServiceAccount of
    `namespace`; the token is bound to a pod (user.extra pod-name and pod-uid) named
    <deployment>-(prefill|decode)-<ordinal>; and the advertisement names that same pod, role and deployment.
    Results are cached by token hash (success for `cache_seconds`, rejections for `negative_cache_seconds`) so
    renewals cost no API call."""

    mode = "kubernetes"

    def __init__(self, *, deployment: str, namespace: str, reviewer: TokenReviewer,
                 close: Callable[[], Awaitable[None]] | None = None, audience: str | None = wire_env.TOKEN_AUDIENCE,
                 cache_seconds: float = 60.0, negative_cache_seconds: float = 5.0, cache_size: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not deployment or not namespace:
            raise ValueError(f"--auth kubernetes needs the deployment (--deployment or ${wire_env.DEPLOYMENT}) and the "
                             "namespace (--namespace, $POD_NAMESPACE or the in-cluster ServiceAccount)")
        self.deployment, self.namespace, self.audience = deployment, namespace, audience or None
        self._review, self._close = reviewer, close
        self._pods = pod_name_pattern(deployment)
        self._sa_prefix = f"system:serviceaccount:{namespace}:"
        self.cache_seconds, self.negative_cache_seconds = cache_seconds, negative_cache_seconds
        self.cache_size = cache_size
        self.clock = clock
        self._cache: dict[str, tuple[float, Identity | HttpError]] = {}
        self.reviews = 0  # TokenReviews sent (tests, debugging)

    def _remember(self, key: str, value: Identity | HttpError, ttl: float) -> None:
        now = self.clock()
        if len(self._cache) >= self.cache_size:
            for k in [k for k, (exp, _) in self._cache.items() if exp <= now]:
                del self._cache[k]
            while len(self._cache) >= self.cache_size:
                del self._cache[next(iter(self._cache))]
        self._cache[key] = (now + ttl, value)

    async def authenticate(self, request: web.Request) -> Identity:
        token = bearer_token(request)
        key = hashlib.sha256(token.encode()).hexdigest()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > self.clock():
            if isinstance(hit[1], HttpError):
                raise hit[1]
            return hit[1]
        try:
            self.reviews += 1
            status = await self._review(token, [self.audience] if self.audience else None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the apiserver is down or refuses us: not the caller's fault, so not a 401
            log.warning("TokenReview failed: %s", e)
            raise HttpError(503, "auth_unavailable", f"cannot verify the token now (TokenReview failed: "
                            f"{type(e).__name__}); retry later", headers={"Retry-After": "1"}) from None
        try:
            identity = self._identity(status)
        except HttpError as e:
            self._remember(key, e, self.negative_cache_seconds)
            raise
        self._remember(key, identity, self.cache_seconds)
        return identity

    def _identity(self, status: dict[str, Any]) -> Identity:
        if not status.get("authenticated"):
            raise unauthenticated("token not authenticated by the Kubernetes API"
                                   + (f" (audience {self.audience})" if self.audience else ""))
        if self.audience and self.audience not in (status.get("audiences") or []):
            raise unauthenticated(f"token is not valid for audience {self.audience!r}")
        user = status.get("user") or {}
        username = user.get("username") or ""
        if not username.startswith("system:serviceaccount:"):
            raise forbidden(f"user {username!r} is not a ServiceAccount")
        if not username.startswith(self._sa_prefix):
            raise forbidden(f"ServiceAccount {username!r} is not in namespace {self.namespace!r}")
        extra = user.get("extra") or {}
        pod_names, pod_uids = extra.get(POD_NAME_EXTRA) or [], extra.get(POD_UID_EXTRA) or []
        if len(pod_names) != 1 or len(pod_uids) != 1:
            raise forbidden("token is not bound to a pod (use the pod's projected ServiceAccount token)")
        pod_name, pod_uid = pod_names[0], pod_uids[0]
        if not self._pods.match(pod_name):
            raise forbidden(f"pod {pod_name!r} is not an engine of deployment {self.deployment!r} "
                             f"(expected {self.deployment}-prefill-N or {self.deployment}-decode-N)")
        return Identity(username, pod_name, pod_uid)

    def authorize_advertisement(self, identity: Identity, adv: EngineAdvertisement) -> None:
        if adv.pod_name != identity.pod_name or adv.pod_uid != identity.pod_uid:
            raise forbidden(f"the token belongs to pod {identity.pod_name} (uid {identity.pod_uid}), the "
                             f"advertisement names pod {adv.pod_name} (uid {adv.pod_uid})")
        match = self._pods.match(identity.pod_name or "")
        if match is None or match["role"] != adv.role:
            raise forbidden(f"pod {identity.pod_name} may not advertise a {adv.role} engine")

    def authorize_entry(self, identity: Identity, stored: EngineAdvertisement) -> None:
        if stored.pod_name != identity.pod_name or stored.pod_uid != identity.pod_uid:
            raise forbidden(f"engine {stored.engine_id} belongs to pod {stored.pod_name}, not {identity.pod_name}")

    async def close(self) -> None:
        if self._close is not None:
            await self._close()
