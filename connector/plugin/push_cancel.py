"""Push mode: a decode never frees KV blocks that a prefill may still WRITE, and a prefill learns at once that a
registration it holds was dropped.

vLLM 0.32's push protocol has no way back from decode to prefill once decode has sent its registration
(PUSH_REG): the prefill engine keeps the registration until its own prefill finishes and then WRITEs, whatever
became of the decode request meanwhile. So:

- a decode request aborted by its client, or failed by the registration timeout, releases blocks that the
  prefill may WRITE later, into KV that by then belongs to another request (vllm#55470). vLLM's scheduler
  holds an aborted request's blocks until its worker reports the receive done, but nothing ever reports it
  when the KV never comes: the blocks stay held until the registration timeout, so a few aborts a second fill
  a decode's KV cache with dead requests and stall everyone else;
- a prefill whose decode leg was aborted before it registered keeps the finished prefill's blocks for its whole
  lease (30 s), so aborts fill the prefill's KV cache too;
- a WRITE that fails leaves decode waiting for KV that will never come (vllm#50754).

This module adds the missing messages, carried as NIXL notifications between the engines' existing agents:

- `cancel` (decode → prefill): the decode will not use this request's KV. The prefill drops the registration
  if it still holds it, releases the finished prefill's blocks if it holds them, refuses any WRITE for the
  request from then on, and answers `ack` once no WRITE of it is in flight;
- `ack` (prefill → decode): this prefill rank will never WRITE the request again. When every prefill rank the
  decode registered with has answered, the decode reports the receive done as failed, through vLLM's own path
  for a failed receive: an aborted request's blocks are freed, a timed-out one gets its error;
- `fail` (prefill → decode): this prefill rank's WRITE of the request failed; the decode cancels as above.

Invariants:
- a decode frees a cancelled request's blocks only after every prefill rank it registered with has answered,
  or after `deadline + DEADLINE_GRACE` (the prefill's rank may be gone): a prefill never starts a WRITE for a
  registration whose deadline, stamped by the decode in wall-clock time, has passed;
- the messages are shaped as vLLM heartbeats naming no request (`HB:disagg-control/1 <base64 of JSON>`: one
  token with a space in it, which no request id has), so an engine
  without the plugin, or one where it stepped aside, reads them as a heartbeat that extends nothing; a decode
  whose prefill never answers waits for the deadline, as without this module;
- every NIXL call runs on the push writer thread, as vLLM's do (`WorkerShim.hook_push_control`).

The bookkeeping here is pure; the hooks into vLLM's worker and scheduler are in `vllm_shim`.
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger("disagg.plugin")

CONTROL_PREFIX = b"HB:disagg-control/1 "
"""Every control message starts with this: vLLM's heartbeat prefix, then a token that is no request id."""
DEADLINE_GRACE = 10.0
"""Seconds past a registration's deadline after which a decode frees a cancelled request's blocks without an
answer: more than the clock skew between nodes and the longest a posted WRITE takes to land."""
WAKE_SECONDS = 0.02
"""How often an idle push writer is woken to read control messages (vLLM wakes it only when its engine steps,
and an idle prefill does not step)."""
Op = Literal["cancel", "ack", "fail"]
Rank = tuple[int, int]
"""A worker's (pp rank, tp rank)."""


@dataclass(frozen=True)
class Address:
    """Where an engine's worker can be reached for a NIXL handshake, and which of its ranks speaks."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int = 1
    rank: Rank = (0, 0)


@dataclass(frozen=True)
class Control:
    op: Op
    request_id: str
    """The decode's request id (vLLM's, with its random suffix): what the decode's worker knows it by."""
    sender: Address
    deadline: float | None = None
    """`cancel`: wall-clock time after which the registration is void anyway."""

    def encode(self) -> bytes:
        s = self.sender
        body = {"op": self.op, "rid": self.request_id, "deadline": self.deadline,
                "from": [s.engine_id, s.host, s.port, s.tp_size, s.pp_size, list(s.rank)]}
        return CONTROL_PREFIX + base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode())


def is_control(message: bytes) -> bool:
    return message.startswith(CONTROL_PREFIX)


def decode(message: bytes) -> Control | None:
    """The control message, or None (logged) for anything malformed: a peer's bytes never raise here."""
    try:
        body = json.loads(base64.urlsafe_b64decode(message[len(CONTROL_PREFIX):]))
        engine, host, port, tp, pp, rank = body["from"]
        op, rid, deadline = body["op"], body["rid"], body.get("deadline")
        if op not in ("cancel", "ack", "fail") or not isinstance(rid, str) or not isinstance(engine, str) \
                or not isinstance(host, str) or not all(isinstance(v, int) for v in (port, tp, pp, *rank)) \
                or not (deadline is None or isinstance(deadline, (int, float))):
            raise ValueError(body)
        return Control(op, rid, Address(engine, host, port, tp, pp, (rank[0], rank[1])), deadline)
    except (ValueError, TypeError, KeyError, IndexError, binascii.Error) as e:
        log.warning("disagg plugin: ignoring a malformed control message (%r): %s", message[:200], e)
        return None


@dataclass(frozen=True)
class CancelOrder:
    """What a decode's scheduler tells its workers to cancel (in the step's connector metadata)."""

    request_id: str
    prefill: Address
    deadline: float
    """Wall-clock time after which the prefill honours the registration no more (its `disagg_deadline`)."""
    holds_blocks: bool
    """The request holds blocks registered with the prefill (an abort after registration, or a timeout); False
    for a request aborted before it was ever allocated, whose cancel only frees the prefill's blocks."""
    reason: Literal["aborted", "timed out"] = "aborted"


@dataclass
class Outgoing:
    to: Address
    message: Control
    notif_only: bool
    """Reach `to` through a notification-only agent (a decode talking to its prefill, like PUSH_REG)."""
    all_ranks: bool
    """Send to every loaded rank of `to` (a cancel); else to `to.rank` (an answer), or every rank if that one
    is not loaded."""
    sent: Callable[[int], None] = lambda n: None
    """Called (writer thread) with the number of ranks it was sent to."""


class Mailbox:
    """Control messages waiting for the writer thread, the only thread that may call NIXL. Thread-safe."""

    def __init__(self, wake: Callable[[], Any]) -> None:
        self._queue: deque[Outgoing] = deque()
        self._wake = wake

    def post(self, item: Outgoing) -> None:
        self._queue.append(item)
        self._wake()

    def take(self) -> list[Outgoing]:
        out = []
        while self._queue:
            out.append(self._queue.popleft())
        return out

    def put_back(self, items: Iterable[Outgoing]) -> None:
        self._queue.extendleft(reversed(list(items)))

    def __len__(self) -> int:
        return len(self._queue)


# -- the decode side -------------------------------------------------------------------------------------------
@dataclass
class _Awaiting:
    prefill: Address
    free_at: float  # monotonic
    reason: str
    expected: int | None = None  # ranks the cancel went to; None until it is sent
    answered: set[Rank] = field(default_factory=set)


class DecodeCancels:
    """A push decode worker's cancels: sent once, answered by every prefill rank, or given up on at the deadline.

    `fail_receive(request_id)` is vLLM's failed-receive path (`WorkerShim.fail_receive`): called once per
    cancelled request that holds blocks, when it is safe to free them. `has_receive(request_id)`: this worker
    waits for that request's KV."""

    def __init__(self, me: Address, mailbox: Mailbox, fail_receive: Callable[[str], bool],
                 has_receive: Callable[[str], bool], clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.me, self.mailbox, self.fail_receive, self.has_receive = me, mailbox, fail_receive, has_receive
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._awaiting: dict[str, _Awaiting] = {}
        self.counts = {"cancelled": 0, "answered": 0, "gave_up": 0}

    def cancel(self, order: CancelOrder) -> None:
        """Tell the prefill (any thread). A request that holds blocks is failed once every rank answered."""
        with self._lock:
            if order.request_id in self._awaiting:
                return
            if order.holds_blocks:
                free_at = self.clock() + max(0.0, order.deadline - self.wall()) + DEADLINE_GRACE
                self._awaiting[order.request_id] = _Awaiting(order.prefill, free_at, order.reason)
            self.counts["cancelled"] += 1

        def sent(n: int, rid: str = order.request_id) -> None:
            with self._lock:
                if (entry := self._awaiting.get(rid)) is not None:
                    entry.expected = n
            self._settle(rid)

        self.mailbox.post(Outgoing(order.prefill, Control("cancel", order.request_id, self.me, order.deadline),
                                   notif_only=True, all_ranks=True, sent=sent))

    def on_message(self, msg: Control) -> None:
        """An answer from a prefill rank (writer thread)."""
        if msg.op == "cancel":
            return  # a decode registers with nobody; a cancel sent to it is a misdirected message
        with self._lock:
            entry = self._awaiting.get(msg.request_id)
            if entry is not None:
                entry.answered.add(msg.sender.rank)
        if entry is None:
            if msg.op == "fail" and self.has_receive(msg.request_id):
                # That prefill rank's WRITE failed and it will not retry: give up on the KV, as on a timeout.
                self.cancel(CancelOrder(msg.request_id, msg.sender, self.wall(), holds_blocks=True,
                                        reason="timed out"))
                with self._lock:
                    if (entry := self._awaiting.get(msg.request_id)) is not None:
                        entry.answered.add(msg.sender.rank)
            return
        self._settle(msg.request_id)

    def _settle(self, request_id: str) -> None:
        with self._lock:
            entry = self._awaiting.get(request_id)
            if entry is None or entry.expected is None or len(entry.answered) < entry.expected:
                return
            del self._awaiting[request_id]
            self.counts["answered"] += 1
        self.fail_receive(request_id)

    def give_up_due(self) -> list[str]:
        """Free the requests whose prefill did not answer by the deadline (any thread); returns their ids."""
        now = self.clock()
        with self._lock:
            due = [rid for rid, e in self._awaiting.items() if now >= e.free_at]
            for rid in due:
                del self._awaiting[rid]
            self.counts["gave_up"] += len(due)
        for rid in due:
            log.warning("disagg plugin: request %s: its prefill did not answer the cancel by the registration "
                        "deadline; releasing its blocks", rid)
            self.fail_receive(rid)
        return due

    def pending(self) -> int:
        with self._lock:
            return len(self._awaiting)


# -- the prefill side ------------------------------------------------------------------------------------------
class PrefillCancels:
    """A push prefill worker's side: which decode requests were cancelled, and which WRITEs are in flight.

    `base_id` is vLLM's `get_base_request_id` (a request id without its random suffix: the prefill's and the
    decode's ids of one request share it). `release(finished_id)` hands a finished prefill's blocks back to the
    scheduler (its lease ends now)."""

    def __init__(self, me: Address, mailbox: Mailbox, base_id: Callable[[str], str],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.me, self.mailbox, self.base_id = me, mailbox, base_id
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._cancelled: dict[str, float] = {}  # base id -> monotonic expiry
        self._posted: dict[str, tuple[Address, str]] = {}  # finished id -> (decode, decode request id)
        self._answer_after_write: dict[str, list[Control]] = {}  # finished id -> cancels to answer when done
        self._releases: deque[str] = deque()
        self.counts = {"cancels": 0, "dropped_registrations": 0, "released": 0, "refused_writes": 0,
                       "failed_writes": 0}

    # writer thread
    def on_cancel(self, msg: Control, drop_registration: Callable[[str], bool],
                  take_finished: Callable[[str], str | None], write_in_flight: Callable[[str], str | None]) -> None:
        base = self.base_id(msg.request_id)
        expires = self.clock() + max(0.0, (msg.deadline or self.wall()) - self.wall()) + 2 * DEADLINE_GRACE
        with self._lock:
            self._cancelled[base] = expires
            self.counts["cancels"] += 1
        if drop_registration(msg.request_id):
            self.counts["dropped_registrations"] += 1
        if (finished := take_finished(msg.request_id)) is not None:
            self.release(finished)
        if (writing := write_in_flight(msg.request_id)) is not None:
            with self._lock:
                self._answer_after_write.setdefault(writing, []).append(msg)
            return
        self._answer(msg, "ack")

    def refuse_write(self, finished_id: str, registration: dict[str, Any]) -> bool:
        """Whether the WRITE of `finished_id` into `registration` must not start (writer thread): the decode
        cancelled it, or its deadline passed. A refused WRITE's blocks are released here."""
        cancelled = self.is_cancelled(finished_id)
        deadline = registration.get("disagg_deadline")
        late = isinstance(deadline, (int, float)) and self.wall() > deadline
        if not (cancelled or late):
            return False
        self.counts["refused_writes"] += 1
        self.release(finished_id)
        if late and not cancelled:
            log.warning("disagg plugin: not writing request %s: its decode's registration deadline has passed",
                        finished_id)
            decode = _decode_of(registration)
            if decode is not None:
                self._answer(Control("cancel", str(registration.get("request_id")), decode), "fail")
        return True

    def posted(self, finished_id: str, registration: dict[str, Any], failed: bool) -> None:
        """A WRITE was handed to NIXL (writer thread); `failed`: its submission failed."""
        decode = _decode_of(registration)
        if decode is None:
            return
        rid = str(registration.get("request_id"))
        if failed:
            self._write_failed(finished_id, decode, rid)
            return
        with self._lock:
            self._posted[finished_id] = (decode, rid)

    def is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return self.base_id(request_id) in self._cancelled

    def writing_to(self, engine_id: str) -> bool:
        """A WRITE posted to that decode engine is not done yet (any thread)."""
        with self._lock:
            return any(decode.engine_id == engine_id for decode, _ in self._posted.values())

    # main thread
    def writes_done(self, done: Iterable[str], failed: Iterable[str]) -> None:
        failed = set(failed)
        for finished_id in done:
            with self._lock:
                posted = self._posted.pop(finished_id, None)
                waiting = self._answer_after_write.pop(finished_id, [])
            if posted is not None and finished_id in failed:
                self._write_failed(finished_id, *posted)
            for msg in waiting:
                self._answer(msg, "ack")

    def _write_failed(self, finished_id: str, decode: Address, request_id: str) -> None:
        self.counts["failed_writes"] += 1
        log.warning("disagg plugin: the WRITE of request %s to decode engine %s failed; telling it at once",
                    finished_id, decode.engine_id)
        self.release(finished_id)
        self._answer(Control("cancel", request_id, decode), "fail")

    def release(self, finished_id: str) -> None:
        self._releases.append(finished_id)

    def take_releases(self) -> list[str]:
        out = []
        while self._releases:
            out.append(self._releases.popleft())
        return out

    def expire(self) -> None:
        now = self.clock()
        with self._lock:
            for base in [b for b, t in self._cancelled.items() if now >= t]:
                del self._cancelled[base]

    def _answer(self, msg: Control, op: Op) -> None:
        """Answer the decode rank that sent `msg`; a `fail`, which answers no message of the decode's (a
        registration does not say which decode rank sent it), goes to every rank, and only the ranks that wait
        for that request act on it."""
        self.mailbox.post(Outgoing(msg.sender, Control(op, msg.request_id, self.me), notif_only=False,
                                   all_ranks=op == "fail"))


def _decode_of(registration: dict[str, Any]) -> Address | None:
    """The decode worker that sent a PUSH_REG registration (vLLM's fields), or None when they are incomplete."""
    try:
        return Address(str(registration["decode_engine_id"]), str(registration["decode_host"]),
                       int(registration["decode_port"]), int(registration["decode_tp_size"]))
    except (KeyError, TypeError, ValueError):
        return None
