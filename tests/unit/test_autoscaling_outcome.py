"""What a planner decision means for a CR: counts written only where they change, cooldown clocks that restart
exactly when a count changes (whoever changed it), and events at transitions only. Real decisions of the pure
planner on the observations of tests/support/autoscaling.py."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from disagg.operator.autoscaling.outcome import outcome, seconds_since_scale
from disagg.operator.autoscaling.planner import decide
from support.autoscaling import NO_THROUGHPUT, POLICY, observe

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def test_a_step_writes_only_the_changed_counts_and_says_why():
    step = decide(observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40), POLICY)
    out = outcome(step, {"prefill": 1, "decode": 1}, None, T0)
    assert out.writes == {"prefill": 4, "decode": 2}
    assert [(e.reason, e.message.split(":")[0]) for e in out.events] == [("Scaled", "prefill 1 → 4"),
                                                                         ("Scaled", "decode 1 → 2")]
    assert out.status.decision == "Rescale" and out.status.prefill.desired == 4 and out.status.prefill.needed == 4
    assert out.status.prefill.last_scale_time == "2026-12-06T12:00:00Z"
    assert seconds_since_scale(out.status, "prefill", T0 + timedelta(seconds=42)) == 42


def test_a_steady_load_writes_nothing_adds_no_event_and_keeps_the_cooldown_clock():
    steady = decide(observe(2, 2, rps=1, isl=3000, osl=700, ttft=400, tpot=50, kv=(1.0, 1.0)), POLICY)
    assert steady.counts == (2, 2)
    first = outcome(steady, {"prefill": 1, "decode": 2}, None, T0)  # someone ran prefill at 1: brought back to 2
    assert first.writes == {"prefill": 2}
    later = T0 + timedelta(minutes=5)
    out = outcome(steady, {"prefill": 2, "decode": 2}, first.status, later)
    assert (out.writes, out.events, out.status.decision) == ({}, (), "Steady")
    assert out.status.prefill.last_scale_time == first.status.prefill.last_scale_time == "2026-12-06T12:00:00Z"
    assert out.status.decode.last_scale_time is None
    assert out.status.last_decision_time == "2026-12-06T12:05:00Z"


def test_a_count_someone_else_changed_restarts_the_cooldown_clock():
    first = outcome(decide(observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40), POLICY),
                    {"prefill": 1, "decode": 1}, None, T0)
    later = T0 + timedelta(minutes=5)
    # kubectl scale took prefill from the planner's 4 to 6; the planner keeps 6 this time (inside the band).
    held = decide(observe(6, 2, rps=1, isl=3000, osl=700, ttft=400, tpot=50, kv=(1.0, 1.0), since=(10, 300)),
                  POLICY)
    assert held.prefill.desired == 6
    out = outcome(held, {"prefill": 6, "decode": 2}, first.status, later)
    assert out.writes == {}
    assert seconds_since_scale(out.status, "prefill", later) == 0
    assert seconds_since_scale(out.status, "decode", later) == 300


def test_scale_to_zero_and_the_wake_are_events_of_their_own():
    to_zero = decide(observe(2, 2, idle=700), POLICY)
    out = outcome(to_zero, {"prefill": 2, "decode": 2}, None, T0)
    assert out.writes == {"prefill": 0, "decode": 0}
    assert [e.reason for e in out.events] == ["Scaled", "Scaled", "ScaledToZero"]
    wake = decide(observe(0, 0, queued=1, idle=700), POLICY)
    out = outcome(wake, {"prefill": 0, "decode": 0}, out.status, T0 + timedelta(hours=1))
    assert out.writes == {"prefill": 1, "decode": 1}
    assert [e.reason for e in out.events] == ["Scaled", "Scaled", "WokeFromZero"]


def test_a_role_held_at_its_maximum_warns_once_not_every_decision():
    limited = decide(observe(8, 2, rps=1, ttft=1500, tpot=80), NO_THROUGHPUT)
    first = outcome(limited, {"prefill": 8, "decode": 2}, None, T0)
    assert first.writes == {} and [(e.type, e.reason) for e in first.events] == [("Warning", "ScaleLimited")]
    again = outcome(limited, {"prefill": 8, "decode": 2}, first.status, T0 + timedelta(seconds=30))
    assert again.events == ()
    hotter = decide(observe(8, 2, rps=1, ttft=3000, tpot=80), NO_THROUGHPUT)
    assert hotter.prefill.reason != limited.prefill.reason
    assert [e.reason for e in outcome(hotter, {"prefill": 8, "decode": 2}, again.status,
                                      T0 + timedelta(seconds=60)).events] == ["ScaleLimited"]
    assert first.status.decision == "Limited"


def test_the_status_is_written_when_a_reader_would_see_a_change_and_else_once_a_minute():
    steady = decide(observe(2, 2, rps=1, isl=3000, osl=700, ttft=400, tpot=50, kv=(1.0, 1.0)), POLICY)
    first = outcome(steady, {"prefill": 2, "decode": 2}, None, T0)
    assert first.publish
    busier = decide(observe(2, 2, rps=1, isl=3000, osl=700, ttft=450, tpot=55, kv=(1.1, 1.0)), POLICY)
    assert busier.counts == steady.counts and busier.prefill.reason != steady.prefill.reason  # readings moved
    assert not outcome(busier, {"prefill": 2, "decode": 2}, first.status, T0 + timedelta(seconds=59)).publish
    assert outcome(busier, {"prefill": 2, "decode": 2}, first.status, T0 + timedelta(seconds=60)).publish
    step = decide(observe(2, 2, rps=5, isl=1600, osl=200, ttft=300, tpot=40), POLICY)
    assert outcome(step, {"prefill": 2, "decode": 2}, first.status, T0 + timedelta(seconds=1)).publish


def test_recommend_writes_nothing_posts_no_scaling_event_and_publishes_the_recommendation():
    step = decide(observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40), POLICY)
    out = outcome(step, {"prefill": 1, "decode": 1}, None, T0, apply=False)
    assert (out.writes, out.events) == ({}, ())
    assert (out.status.prefill.desired, out.status.decode.desired) == (4, 2) and out.publish
    assert (out.status.prefill.current, out.status.prefill.last_scale_time) == (1, None)


def test_a_recommendation_nobody_follows_keeps_the_cooldown_clock_and_one_followed_restarts_it():
    step = decide(observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40), POLICY)
    first = outcome(step, {"prefill": 1, "decode": 1}, None, T0, apply=False)
    ignored = outcome(step, {"prefill": 1, "decode": 1}, first.status, T0 + timedelta(seconds=15), apply=False)
    assert ignored.status.prefill.last_scale_time is None  # 4 recommended, 1 still runs: nothing changed
    followed = outcome(step, {"prefill": 4, "decode": 1}, ignored.status, T0 + timedelta(seconds=30), apply=False)
    assert followed.status.prefill.last_scale_time == "2026-12-06T12:00:30Z"  # an HPA applied it
    assert followed.status.decode.last_scale_time is None


def test_the_planners_own_write_starts_the_cooldown_once_not_again_at_the_next_tick():
    step = decide(observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40), POLICY)
    wrote = outcome(step, {"prefill": 1, "decode": 1}, None, T0)
    assert wrote.status.prefill.current == 4
    later = outcome(step, {"prefill": 4, "decode": 2}, wrote.status, T0 + timedelta(seconds=15))
    assert later.status.prefill.last_scale_time == wrote.status.prefill.last_scale_time == "2026-12-06T12:00:00Z"
