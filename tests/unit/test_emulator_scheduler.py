"""The engine emulator's step model (connector/emulator/scheduler.py): what one step runs (tables of vLLM's
policy: chunked prefill, first come first served, preemption, P/D decode admission) and what it costs, and
properties that hold for any queue: the budget, the free blocks and max_num_seqs are never exceeded."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.connector.emulator.profiles import CPU_KV64K, Contention, RoleContention, StepCosts
from disagg.connector.emulator.scheduler import (
    Scheduled,
    SeqView,
    StepPlan,
    blocks_for,
    plan_step,
    step_seconds,
)

P = CPU_KV64K.model_copy(update={"block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4,
                                 "max_model_len": 512, "num_blocks": 64})


def running(id: str, tokens: int, computed: int | None = None) -> SeqView:
    computed = tokens - 1 if computed is None else computed
    return SeqView(id, "running", tokens, computed, blocks_for(computed, P.block_size), prompt_tokens=tokens)


def new(id: str, tokens: int, hit_blocks: int = 0, hit_free: int = 0) -> SeqView:
    return SeqView(id, "new", tokens, hit_blocks * P.block_size, 0, hit_blocks, hit_free, tokens)


def test_decodes_take_one_token_each_and_a_new_prompt_gets_the_rest_of_the_budget():
    plan = plan_step([running("a", 40), running("b", 40)], [new("c", 100)], 64, P)
    assert plan == StepPlan((Scheduled("a", 39, 1, 0), Scheduled("b", 39, 1, 0),
                             Scheduled("c", 0, 62, 4, admitted=True)), ())


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    plan = plan_step([running("a", 100, computed=64)], [], 64, P)
    assert plan.scheduled == (Scheduled("a", 64, 36, 3),)


def test_a_prefix_hit_skips_computed_tokens_and_costs_only_its_unheld_blocks():
    plan = plan_step([], [new("c", 100, hit_blocks=4, hit_free=1)], 5, P)
    # 64 cached, 36 to compute (3 new blocks) + 1 unheld hit block = 4 of the 5 free.
    assert plan.scheduled == (Scheduled("c", 64, 36, 3, admitted=True),)
    assert plan_step([], [new("c", 100, hit_blocks=4, hit_free=3)], 5, P).scheduled == ()


def test_no_overtaking_a_request_that_does_not_fit():
    plan = plan_step([], [new("big", 64), new("small", 8)], 3, P)
    assert plan.scheduled == ()


def test_max_num_seqs_bounds_the_batch():
    plan = plan_step([running(x, 20) for x in "abcd"], [new("e", 8)], 64, P)
    assert [s.id for s in plan.scheduled] == list("abcd")


def test_a_running_sequence_without_a_block_preempts_the_last_admitted_and_admits_nobody():
    # a needs a new block (it is at a block boundary), none is free; d (last) is preempted to make room.
    plan = plan_step([running("a", 33, computed=32), running("b", 20), running("d", 20)], [new("e", 8)], 0, P)
    assert plan.preempted == ("d",)
    assert [s.id for s in plan.scheduled] == ["a", "b"]


def test_a_sequence_that_cannot_get_a_block_even_alone_waits_again():
    plan = plan_step([running("a", 33, computed=32)], [], 0, P)
    assert plan == StepPlan((), ("a",))


def test_a_pd_decode_holds_its_whole_prompt_at_once_and_computes_nothing_until_its_kv_lands():
    remote = SeqView("r", "remote_new", 40, 0, 0, prompt_tokens=40)
    waiting_kv = SeqView("w", "remote_wait", 40, 0, 3, prompt_tokens=40)
    landed = SeqView("l", "remote_ready", 40, 39, 3, prompt_tokens=40)
    plan = plan_step([], [waiting_kv, remote, landed], 10, P)
    assert plan.scheduled == (Scheduled("r", 0, 0, 3, admitted=True), Scheduled("l", 39, 1, 0))
    # The landed one's last prompt token costs a decode step's share: its sequence and its context.
    assert step_seconds(plan, P.step) == pytest.approx(
        P.step.fixed_s + P.step.per_sequence_s + 40 * P.step.per_kv_token_s)


COSTS = StepCosts(fixed_s=0.01, per_prefill_token_s=0.001, per_sequence_s=0.002, per_kv_token_s=1e-5,
                  per_attention_pair_s=1e-7)


@pytest.mark.parametrize(("scheduled", "expected"), [
    ((), 0.0),
    # A remote admission computes nothing: no step.
    ((Scheduled("r", 0, 0, 3, admitted=True),), 0.0),
    # A 100-token prefill: 100 prefill tokens, one sequence, 100 KV tokens, 100*101/2 pairs.
    ((Scheduled("p", 0, 100, 7),), 0.01 + 0.1 + 0.002 + 1e-3 + 5050e-7),
    # Its second chunk attends over the first too.
    ((Scheduled("p", 64, 36, 3),), 0.01 + 0.036 + 0.002 + 100e-5 + (36 * 64 + 36 * 37 / 2) * 1e-7),
    # Two decodes at contexts 300 and 100: a sequence each and their KV, no prefill token, no pair.
    ((Scheduled("a", 300, 1, 0), Scheduled("b", 100, 1, 0)), 0.01 + 0.004 + 402e-5),
    # A decode beside a prefill chunk: one step pays both.
    ((Scheduled("a", 300, 1, 0), Scheduled("p", 0, 10, 1)), 0.01 + 0.01 + 0.004 + 311e-5 + 55e-7),
])
def test_a_step_costs_its_fixed_part_and_each_term(scheduled, expected):
    assert step_seconds(StepPlan(scheduled, ()), COSTS) == pytest.approx(expected)


def test_a_step_costs_more_with_every_sequence_and_every_context_token():
    base = step_seconds(StepPlan((Scheduled("a", 100, 1, 0),), ()), COSTS)
    more_seqs = step_seconds(StepPlan((Scheduled("a", 100, 1, 0), Scheduled("b", 1, 1, 0)), ()), COSTS)
    longer = step_seconds(StepPlan((Scheduled("a", 200, 1, 0),), ()), COSTS)
    assert base < more_seqs and base < longer


views = st.lists(st.tuples(st.sampled_from(["running", "new", "remote_new", "remote_wait", "remote_ready"]),
                           st.integers(1, 300), st.integers(0, 20)), max_size=12)


@given(views, views, st.integers(0, 64))
def test_a_plan_never_exceeds_the_budget_the_blocks_or_max_num_seqs(run_spec, wait_spec, free):
    run = [running(f"r{i}", tokens, computed=max(0, tokens - 1 - extra % 3))
           for i, (_, tokens, extra) in enumerate(run_spec)]
    wait = []
    for i, (phase, tokens, extra) in enumerate(wait_spec):
        if phase in ("new", "running"):
            hit = min(extra, (tokens - 1) // P.block_size)
            wait.append(new(f"w{i}", tokens, hit, min(hit, extra % 4)))
        elif phase == "remote_new":
            wait.append(SeqView(f"w{i}", "remote_new", tokens, 0, 0, prompt_tokens=tokens))
        else:
            held = blocks_for(tokens, P.block_size)
            wait.append(SeqView(f"w{i}", phase, tokens, tokens - 1, held, prompt_tokens=tokens))  # type: ignore[arg-type]
    plan = plan_step(run, wait, free, P)
    assert sum(s.tokens for s in plan.scheduled) <= P.max_num_batched_tokens
    ids = [s.id for s in plan.scheduled]
    assert len(ids) == len(set(ids)) and not set(ids) & set(plan.preempted)
    assert "remote_wait" not in {v.phase for v in wait if v.id in ids}
    by_id = {v.id: v for v in [*run, *wait]}
    freed = sum(by_id[p].held_blocks for p in plan.preempted)
    taken = sum(s.new_blocks + (by_id[s.id].hit_free_blocks if s.admitted else 0) for s in plan.scheduled)
    assert taken <= free + freed
    computing = len(run) - len(plan.preempted) + sum(1 for s in plan.scheduled if s.admitted and s.tokens)
    assert computing <= max(P.max_num_seqs, len(run))
    if plan.preempted:
        assert not any(s.admitted for s in plan.scheduled), "no admission in a step that preempts"
    for s in plan.scheduled:
        v = by_id[s.id]
        assert s.start + s.tokens <= max(v.tokens, s.start) and s.start + s.tokens <= P.max_model_len


def test_contention_stretches_a_step_by_its_share_and_adds_its_cost_per_sequence():
    c = Contention(share=0.1, per_sequence_s=0.005)
    decode3 = StepPlan(tuple(Scheduled(str(i), 100, 1, 0) for i in range(3)), ())
    model = step_seconds(decode3, COSTS)
    assert step_seconds(decode3, COSTS, c) == pytest.approx(model * 1.1 + 3 * 0.005)
    assert step_seconds(decode3, COSTS, Contention()) == pytest.approx(model), "an engine that owns its compute"
    assert step_seconds(StepPlan((), ()), COSTS, c) == 0.0, "a step that computes nothing costs nothing"
    assert RoleContention(decode=c).of("decode") is c and RoleContention(decode=c).of("prefill") == Contention()
