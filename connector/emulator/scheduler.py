"""One step of a continuous-batching scheduler, and what it costs. Pure: views of the sequences in, a plan out.

The policy is vLLM V1's (v1/core/sched/scheduler.py), reduced to what changes timing and capacity:
- a step has a token budget (`max_num_batched_tokens`): running sequences first, in admission order (a decode
  takes one token, a prefill in progress the rest of its prompt or what the budget leaves: chunked prefill),
  then waiting sequences first come, first served, while the budget, `max_num_seqs` and free blocks allow;
- a sequence holds the blocks for the tokens it has computed plus those of this step; a running sequence that
  cannot get a block preempts the last running one (which recomputes from scratch later), or itself;
- the first waiting sequence that does not fit stops admission (no overtaking), except P/D decode sequences still
  waiting for their KV, which are skipped;
- a P/D decode sequence is admitted in two moves: its blocks for the whole prompt are held at once, with no
  compute (`remote_new`); once its KV has landed it runs its last prompt token like any sequence (`remote_ready`).

Invariants (tests/unit/test_emulator_scheduler.py): the plan never computes more tokens than the budget, never
holds more blocks than are free (counting what preemption frees), never runs more than `max_num_seqs`, and a
sequence is never both scheduled and preempted.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from .profiles import Contention, EmulatorProfile, StepCosts

Phase = Literal["new", "running", "remote_new", "remote_wait", "remote_ready"]
"""- new: waiting to be admitted (first time, or after a preemption); it computes its prompt here;
- running: admitted, computing its prompt in chunks or decoding;
- remote_new: a P/D decode sequence that holds no blocks yet;
- remote_wait: one that holds its blocks and waits for its KV (not schedulable);
- remote_ready: one whose KV has landed: it computes its last prompt token, then decodes."""


@dataclass(frozen=True)
class SeqView:
    """What the scheduler needs of one sequence."""

    id: str
    phase: Phase
    tokens: int
    """Tokens the sequence has: its prompt and what it has generated so far."""
    computed: int
    """Tokens whose KV it holds (new, remote_new: what its prefix-cache hit will give it)."""
    held_blocks: int
    """Blocks it holds now (new, remote_new: 0)."""
    hit_blocks: int = 0
    """new, remote_new: cached blocks its hit takes (counted in `computed`)."""
    hit_free_blocks: int = 0
    """Of those, how many are unheld now (taking them uses up free blocks)."""
    prompt_tokens: int = 0
    """Its prompt's length (remote_new: the blocks it holds cover all of it)."""


@dataclass(frozen=True)
class Scheduled:
    id: str
    start: int
    """Tokens with KV before this step."""
    tokens: int
    """Tokens this step computes (0 for a remote admission)."""
    new_blocks: int
    """Blocks this step allocates for it (beyond its hit's)."""
    admitted: bool = False
    """It was waiting; it takes its prefix-cache hit now."""


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[Scheduled, ...]
    preempted: tuple[str, ...]

    @property
    def computes(self) -> bool:
        return any(s.tokens for s in self.scheduled)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_step(running: Sequence[SeqView], waiting: Iterable[SeqView], free_blocks: int,
              profile: EmulatorProfile) -> StepPlan:
    """The next step. `running` in admission order, `waiting` in arrival order (preempted ones first); `waiting` is
    read only as far as admission goes, so it may be lazy."""
    bs, budget, free = profile.block_size, profile.max_num_batched_tokens, free_blocks
    scheduled: list[Scheduled] = []
    preempted: list[str] = []
    queue = list(running)
    i = 0
    while i < len(queue) and budget > 0:
        s = queue[i]
        n = min(s.tokens - s.computed, budget, profile.max_model_len - s.computed)
        if n <= 0:
            i += 1
            continue
        need = max(0, blocks_for(s.computed + n, bs) - s.held_blocks)
        while need > free and len(queue) > i + 1:
            victim = queue.pop()  # the last admitted one: vLLM's lowest priority
            preempted.append(victim.id)
            free += victim.held_blocks
        if need > free:
            preempted.append(s.id)  # not even the others' blocks make room: it waits again itself
            queue.pop(i)
            free += s.held_blocks
            break
        free -= need
        budget -= n
        scheduled.append(Scheduled(s.id, s.computed, n, need))
        i += 1
    if preempted:
        return StepPlan(tuple(scheduled), tuple(preempted))
    active = len(queue)
    for w in waiting:
        if budget <= 0 or active >= profile.max_num_seqs:
            break
        if w.phase == "remote_wait":
            continue
        if w.phase == "remote_new":
            need = w.hit_free_blocks + blocks_for(w.prompt_tokens, bs) - w.hit_blocks
            if need > free:
                break
            free -= need
            scheduled.append(Scheduled(w.id, w.computed, 0, need - w.hit_free_blocks, admitted=True))
            continue
        n = min(w.tokens - w.computed, budget)
        need = w.hit_free_blocks + max(0, blocks_for(w.computed + n, bs) - w.hit_blocks - w.held_blocks)
        if need > free:
            break
        free -= need
        budget -= n
        active += 1
        scheduled.append(Scheduled(w.id, w.computed, n, need - w.hit_free_blocks, admitted=w.phase == "new"))
    return StepPlan(tuple(scheduled), ())


NO_CONTENTION = Contention()
"""An engine that owns its compute."""


def step_seconds(plan: StepPlan, costs: StepCosts, contention: Contention = NO_CONTENTION) -> float:
    """What the step costs. A sequence that computes one token is decoding (per sequence: an output token, or the
    last prompt token a P/D decode computes again after its KV landed, which costs as much); one that computes more
    runs a prefill chunk (per prefill token and attention pair; a recompute after preemption is one too). A step
    that computes nothing costs 0. `contention` adds the serving path's part (profiles.Contention)."""
    prefill = seqs = kv = pairs = 0
    for s in plan.scheduled:
        if not s.tokens:
            continue
        seqs += 1
        kv += s.start + s.tokens
        if s.tokens == 1:
            continue
        prefill += s.tokens
        pairs += s.tokens * s.start + s.tokens * (s.tokens + 1) // 2
    if not seqs:
        return 0.0
    model = (costs.fixed_s + costs.per_prefill_token_s * prefill + costs.per_sequence_s * seqs
             + costs.per_kv_token_s * kv + costs.per_attention_pair_s * pairs)
    return contention.apply(model, seqs)
