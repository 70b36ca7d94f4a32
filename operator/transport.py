"""What each deployment's engines report about their KV transport, read from the deployment's rendezvous.

The engines' plugin advertises the NIXL backend it really instantiated (`EngineAdvertisement.transport`); the
operator reads `GET /v1/engines` (reads need no token) and turns the answer into the TransportVerified condition
(status.py). Bounds:
- a reconcile never waits for a rendezvous: status passes read the cached last answer (`report`) and at most
  start a background refresh (`request`);
- each refresh is one GET bounded by `timeout`; at most `concurrency` run at once;
- a refresh whose answer differs from the cached one calls `on_change(key)` (the operator runs a status pass);
  an unchanged answer does nothing, so an idle deployment causes no status writes;
- an unreachable rendezvous is an answer too (`TransportReport.error`, a short stable text).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import aiohttp
from pydantic import ValidationError

from disagg.connector.rendezvous.client import RendezvousClient, RendezvousError

from . import metrics, names
from .names import Key
from .status import EngineTransport, TransportReport

DEFAULT_TEMPLATE = names.DEFAULT_RENDEZVOUS_TEMPLATE

log = logging.getLogger("disagg.operator.transport")


def rendezvous_url(template: str, namespace: str, name: str) -> str:
    return template.format(name=name, namespace=namespace)


def check_template(template: str) -> str:
    """Raise ValueError unless the template formats with {name} and {namespace} into an http(s) URL."""
    try:
        url = rendezvous_url(template, "ns", "cr")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"--rendezvous-url-template {template!r}: only {{name}} and {{namespace}} may be used "
                         f"({e!r})") from None
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--rendezvous-url-template {template!r} must give an http:// or https:// URL")
    return template


NO_ANSWER, NO_NAME, NO_CONNECTION = "no answer in time", "cannot resolve its host name", "connection failed"
UNREACHABLE = frozenset({NO_ANSWER, NO_NAME, NO_CONNECTION})
"""Symptoms of one outage, a rendezvous that cannot be reached: which one a poll meets can change from poll to
poll (a name lookup that sometimes outlasts the timeout) while nothing changed."""


def describe_error(e: BaseException) -> str:
    """Short and stable (it becomes a condition message): the kind of failure, not the socket details."""
    if isinstance(e, asyncio.TimeoutError):
        return NO_ANSWER
    if isinstance(e, RendezvousError):
        return f"HTTP {e.status} ({e.reason})" if e.status else f"unusable answer ({e.reason})"
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, socket.gaierror) or type(e).__name__ == "ClientConnectorDNSError":
            return NO_NAME
        return NO_CONNECTION
    if isinstance(e, (ValidationError, ValueError)):
        return "the answer is not an engine list"
    if isinstance(e, (aiohttp.ClientError, OSError)):
        return f"request failed ({type(e).__name__})"
    return f"unexpected error ({type(e).__name__})"


def same_outage(before: TransportReport, after: TransportReport) -> bool:
    """Whether two answers are the same unreachable rendezvous at the same URL, whatever symptom each met."""
    return before.url == after.url and before.error in UNREACHABLE and after.error in UNREACHABLE


class TransportPoller:
    def __init__(self, template: str = DEFAULT_TEMPLATE, *, timeout: float = 2.0, interval: float = 30.0,
                 concurrency: int = 16, on_change: Callable[[Key], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.template = check_template(template)
        self.timeout, self.interval = timeout, interval
        self.on_change = on_change
        self._clock = clock
        self._reports: dict[Key, TransportReport] = {}
        self._polled_at: dict[Key, float] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()  # forced while a refresh ran: its answer may predate what forced it
        self._clients: dict[Key, RendezvousClient] = {}
        self._gate = asyncio.Semaphore(concurrency)
        self.polls = 0

    def url(self, key: Key) -> str:
        return rendezvous_url(self.template, *key)

    def report(self, key: Key) -> TransportReport | None:
        """The last answer for this deployment; None before the first one."""
        return self._reports.get(key)

    def keys(self) -> set[Key]:
        """Deployments with a cached answer or a refresh running."""
        return set(self._reports) | set(self._tasks)

    def request(self, key: Key, *, force: bool = False) -> None:
        """Refresh in the background, unless (without `force`) the last one is recent. A forced request while a
        refresh runs makes one more refresh after it, so an answer never predates the change that asked for it."""
        if key in self._tasks:
            if force:
                self._again.add(key)
            return
        last = self._polled_at.get(key)
        if not force and last is not None and self._clock() - last < self.interval:
            return
        self._tasks[key] = asyncio.create_task(self._refresh_task(key), name=f"transport {key[0]}/{key[1]}")

    async def _refresh_task(self, key: Key) -> None:
        try:
            await self.refresh(key)
        except asyncio.CancelledError:
            raise
        except Exception:  # a status pass failing must not kill later refreshes
            log.exception("transport refresh of %s/%s failed", *key)
        finally:
            if self._tasks.get(key) is asyncio.current_task():  # not a newer refresh started after forget()
                del self._tasks[key]
                if key in self._again:
                    self._again.discard(key)
                    self.request(key, force=True)

    async def fetch(self, key: Key) -> TransportReport:
        url = self.url(key)
        client = self._clients.get(key)
        if client is None or client.url != url.rstrip("/"):
            client = self._clients[key] = RendezvousClient(url, timeout=self.timeout)
        try:
            async with asyncio.timeout(self.timeout):
                listing = await client.list()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("rendezvous %s of %s/%s: %r", url, *key, e)
            metrics.RENDEZVOUS_POLLS.labels(result="error").inc()
            return TransportReport(url=url, error=describe_error(e))
        metrics.RENDEZVOUS_POLLS.labels(result="ok").inc()
        engines = tuple(sorted((EngineTransport(a.pod_name or a.engine_id, a.role, a.transport, a.pod_uid)
                                for a in listing.engines if a.deployment == key[1]),
                               key=lambda e: (e.engine, e.role)))
        return TransportReport(url=url, engines=engines)

    async def refresh(self, key: Key) -> TransportReport:
        """Ask the rendezvous now; store the answer; `on_change(key)` when it differs from the cached one."""
        async with self._gate:
            report = await self.fetch(key)
        self.polls += 1
        self._polled_at[key] = self._clock()
        before = self._reports.get(key)
        if before is not None and same_outage(before, report):
            log.debug("rendezvous of %s/%s still unreachable: %s (reported: %s)", *key, report.error, before.error)
            report = before  # another symptom of the same outage: no change, so no status write
        self._reports[key] = report
        if report != before:
            if before is None or before.error != report.error:
                log.info("rendezvous of %s/%s: %s", *key, report.error or f"{len(report.engines)} engine(s)")
            if self.on_change is not None:
                await self.on_change(key)
        return report

    def forget(self, key: Key) -> None:
        """The deployment is gone: drop its cache, its refresh and its client."""
        self._reports.pop(key, None)
        self._polled_at.pop(key, None)
        self._again.discard(key)
        task = self._tasks.pop(key, None)
        if task is not None and task is not asyncio.current_task():  # a pass run by the refresh itself
            task.cancel()
        client = self._clients.pop(key, None)
        if client is not None:
            asyncio.ensure_future(client.close())

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
