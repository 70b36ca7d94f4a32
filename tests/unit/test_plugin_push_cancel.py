"""The bookkeeping of push cancels (connector/plugin/push_cancel.py): when a decode may free a cancelled request's
blocks, and what a prefill does with a cancel.

Pure: no vLLM, no NIXL. `Clock` is a FAKE clock (monotonic and wall time advanced by hand); the mailbox is the
real one, read by the test instead of a writer thread. tests/engines drives the same code on real engines.
"""
from __future__ import annotations

import base64
import re

import pytest

from disagg.connector.plugin.push_cancel import (
    CONTROL_PREFIX,
    DEADLINE_GRACE,
    Address,
    CancelOrder,
    Control,
    DecodeCancels,
    Mailbox,
    Outgoing,
    PrefillCancels,
    decode,
    is_control,
)

PREFILL = Address("prefill-1", "10.0.0.1", 5600, tp_size=2)
DECODE = Address("decode-1", "10.0.0.2", 5601, tp_size=1, rank=(0, 0))


class Clock:
    """FAKE: monotonic and wall-clock time, moved by the test."""

    def __init__(self) -> None:
        self.mono, self.wall_time = 100.0, 1_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.wall_time

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall_time += seconds


def base_id(request_id: str) -> str:
    """vLLM's get_base_request_id: the id without its random `-xxxxxxxx` suffix."""
    return re.sub(r"-[0-9a-f]{8}$", "", request_id)


def take(mailbox: Mailbox) -> list[Outgoing]:
    return mailbox.take()


# -- the wire ----------------------------------------------------------------------------------------------------
def test_a_control_message_round_trips_and_reads_as_an_empty_heartbeat_elsewhere():
    msg = Control("cancel", "cmpl-abc-0-1234abcd", DECODE, deadline=12.5)
    raw = msg.encode()
    assert is_control(raw) and decode(raw) == msg
    # An engine without the plugin reads `HB:` + request ids separated by commas: this is one id with a space in
    # it, which no vLLM request id has, so a heartbeat that extends no lease.
    assert raw.startswith(b"HB:") and "," not in raw.decode("utf-8") and " " in raw.decode("utf-8")


@pytest.mark.parametrize("raw", [
    CONTROL_PREFIX + b"not base64!", CONTROL_PREFIX + b"e30=",
    *(CONTROL_PREFIX + base64.urlsafe_b64encode(body) for body in (
        b'{"op":"explode","rid":"x","from":[]}', b'{"op":"ack","rid":7,"from":["e","h",1,1,1,[0,0]]}',
        b'{"op":"ack","rid":"x","from":["e","h","port",1,1,[0,0]]}', b"\xff\xfe", b"[1, 2]"))])
def test_malformed_control_messages_are_ignored_not_raised(raw):
    assert decode(raw) is None


# -- the decode side -----------------------------------------------------------------------------------------------
def decode_side(clock: Clock, receives: set[str] | None = None) -> tuple[DecodeCancels, Mailbox, list[str]]:
    freed: list[str] = []
    mailbox = Mailbox(lambda: None)
    receives = receives if receives is not None else set()
    cancels = DecodeCancels(DECODE, mailbox, lambda rid: freed.append(rid) or True, receives.__contains__,
                            clock.monotonic, clock.wall)
    return cancels, mailbox, freed


def test_a_cancelled_request_is_freed_only_when_every_prefill_rank_has_answered():
    clock = Clock()
    cancels, mailbox, freed = decode_side(clock)
    cancels.cancel(CancelOrder("cmpl-r-0-aaaaaaaa", PREFILL, clock.wall() + 60, holds_blocks=True))
    (out,) = take(mailbox)
    assert (out.to, out.message.op, out.message.request_id, out.notif_only, out.all_ranks) == \
        (PREFILL, "cancel", "cmpl-r-0-aaaaaaaa", True, True)
    assert out.message.sender == DECODE and out.message.deadline == clock.wall() + 60
    rank0 = Control("ack", "cmpl-r-0-aaaaaaaa", Address("prefill-1", "10.0.0.1", 5600, 2, rank=(0, 0)))
    rank1 = Control("ack", "cmpl-r-0-aaaaaaaa", Address("prefill-1", "10.0.0.1", 5600, 2, rank=(0, 1)))
    cancels.on_message(rank0)  # answered before the writer reported how many ranks it reached
    out.sent(2)
    assert freed == []
    cancels.on_message(rank0)  # the same rank twice is still one answer
    assert freed == []
    cancels.on_message(rank1)
    assert freed == ["cmpl-r-0-aaaaaaaa"] and cancels.pending() == 0
    cancels.on_message(rank1)
    assert freed == ["cmpl-r-0-aaaaaaaa"], "freed once"


def test_without_an_answer_the_blocks_are_freed_after_the_deadline_and_its_grace():
    clock = Clock()
    cancels, mailbox, freed = decode_side(clock)
    cancels.cancel(CancelOrder("r1", PREFILL, clock.wall() + 30, holds_blocks=True))
    take(mailbox)[0].sent(1)
    clock.advance(30 + DEADLINE_GRACE - 0.1)
    assert cancels.give_up_due() == [] and freed == []
    clock.advance(0.2)
    assert cancels.give_up_due() == ["r1"] and freed == ["r1"] and cancels.counts["gave_up"] == 1


def test_a_request_never_allocated_only_tells_its_prefill():
    clock = Clock()
    cancels, mailbox, freed = decode_side(clock)
    cancels.cancel(CancelOrder("r2", PREFILL, clock.wall() + 30, holds_blocks=False))
    (out,) = take(mailbox)
    assert out.message.op == "cancel"
    out.sent(2)
    cancels.on_message(Control("ack", "r2", PREFILL))
    clock.advance(3600)
    assert cancels.give_up_due() == [] and freed == [] and cancels.pending() == 0


def test_a_failed_write_makes_the_decode_cancel_with_every_prefill_rank():
    clock = Clock()
    cancels, mailbox, freed = decode_side(clock, receives={"r3"})
    failing = Address("prefill-1", "10.0.0.1", 5600, 2, rank=(0, 1))
    cancels.on_message(Control("fail", "r3", failing))
    (out,) = take(mailbox)
    assert (out.to.engine_id, out.message.op, out.all_ranks) == ("prefill-1", "cancel", True)
    out.sent(2)
    assert freed == []  # the failing rank has answered; the other may still be writing
    cancels.on_message(Control("ack", "r3", Address("prefill-1", "10.0.0.1", 5600, 2, rank=(0, 0))))
    assert freed == ["r3"]


def test_a_fail_for_a_request_this_worker_does_not_wait_for_is_ignored():
    cancels, mailbox, freed = decode_side(Clock(), receives=set())
    cancels.on_message(Control("fail", "elsewhere", PREFILL))
    assert take(mailbox) == [] and freed == []


# -- the prefill side ----------------------------------------------------------------------------------------------
ME = Address("prefill-1", "10.0.0.1", 5600, tp_size=1)


def prefill_side(clock: Clock) -> tuple[PrefillCancels, Mailbox]:
    mailbox = Mailbox(lambda: None)
    return PrefillCancels(ME, mailbox, base_id, clock.monotonic, clock.wall), mailbox


def cancel_msg(clock: Clock, rid: str = "cmpl-q-0-dddddddd") -> Control:
    return Control("cancel", rid, DECODE, deadline=clock.wall() + 60)


def test_a_cancel_drops_the_registration_and_is_answered_at_once():
    clock = Clock()
    prefill, mailbox = prefill_side(clock)
    dropped: list[str] = []
    prefill.on_cancel(cancel_msg(clock), lambda rid: dropped.append(rid) or True, lambda rid: None,
                      lambda rid: None)
    assert dropped == ["cmpl-q-0-dddddddd"] and prefill.counts["dropped_registrations"] == 1
    (out,) = take(mailbox)
    assert (out.to, out.message.op, out.message.request_id, out.notif_only, out.all_ranks) == \
        (DECODE, "ack", "cmpl-q-0-dddddddd", False, False)
    # The prefill's own request (another random suffix) finishes later: no WRITE, and its blocks go back.
    assert prefill.is_cancelled("cmpl-q-0-eeeeeeee")
    assert prefill.refuse_write("cmpl-q-0-eeeeeeee", {"request_id": "cmpl-q-0-dddddddd"})
    assert prefill.take_releases() == ["cmpl-q-0-eeeeeeee"]


def test_a_cancel_for_a_finished_prefill_releases_its_blocks():
    clock = Clock()
    prefill, mailbox = prefill_side(clock)
    prefill.on_cancel(cancel_msg(clock), lambda rid: False, lambda rid: "cmpl-q-0-eeeeeeee", lambda rid: None)
    assert prefill.take_releases() == ["cmpl-q-0-eeeeeeee"]
    assert [o.message.op for o in take(mailbox)] == ["ack"]


def test_a_cancel_during_a_write_is_answered_when_the_write_is_done():
    clock = Clock()
    prefill, mailbox = prefill_side(clock)
    prefill.on_cancel(cancel_msg(clock), lambda rid: False, lambda rid: None, lambda rid: "cmpl-q-0-eeeeeeee")
    assert take(mailbox) == [], "not while the WRITE may still land"
    prefill.writes_done({"other"}, set())
    assert take(mailbox) == []
    prefill.writes_done({"cmpl-q-0-eeeeeeee"}, set())
    (out,) = take(mailbox)
    assert (out.message.op, out.to) == ("ack", DECODE)


REGISTRATION = {"request_id": "cmpl-w-0-dddddddd", "decode_engine_id": "decode-1", "decode_host": "10.0.0.2",
                "decode_port": 5601, "decode_tp_size": 1}


def test_a_registration_past_its_deadline_is_never_written_and_its_decode_is_told():
    clock = Clock()
    prefill, mailbox = prefill_side(clock)
    assert not prefill.refuse_write("cmpl-w-0-eeeeeeee", {**REGISTRATION, "disagg_deadline": clock.wall() + 1})
    clock.advance(2)
    assert prefill.refuse_write("cmpl-w-0-eeeeeeee", {**REGISTRATION, "disagg_deadline": clock.wall() - 1})
    assert prefill.take_releases() == ["cmpl-w-0-eeeeeeee"]
    (out,) = take(mailbox)
    assert (out.message.op, out.message.request_id, out.to.engine_id, out.all_ranks) == \
        ("fail", "cmpl-w-0-dddddddd", "decode-1", True)


def test_a_failed_write_tells_its_decode_and_releases_the_blocks():
    clock = Clock()
    prefill, mailbox = prefill_side(clock)
    prefill.posted("p1", REGISTRATION, failed=True)  # the submission itself failed
    prefill.posted("p2", REGISTRATION, failed=False)
    prefill.writes_done({"p2"}, {"p2"})  # the transfer failed
    assert prefill.take_releases() == ["p1", "p2"]
    assert [(o.message.op, o.message.request_id) for o in take(mailbox)] == \
        [("fail", "cmpl-w-0-dddddddd"), ("fail", "cmpl-w-0-dddddddd")]
    prefill.posted("p3", REGISTRATION, failed=False)
    prefill.writes_done({"p3"}, set())
    assert take(mailbox) == [] and prefill.take_releases() == [], "a WRITE that landed needs no word"


def test_cancelled_ids_are_forgotten_after_their_deadline():
    clock = Clock()
    prefill, mailbox = prefill_side(clock)
    prefill.on_cancel(cancel_msg(clock), lambda rid: False, lambda rid: None, lambda rid: None)
    clock.advance(60 + 2 * DEADLINE_GRACE - 1)
    prefill.expire()
    assert prefill.is_cancelled("cmpl-q-0-eeeeeeee")
    clock.advance(2)
    prefill.expire()
    assert not prefill.is_cancelled("cmpl-q-0-eeeeeeee")
