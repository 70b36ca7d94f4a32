"""The planner's invariants over every rollout between sizes 0..5 per role: each step checked against the state
it was planned from (and each plan made while the world is still catching up), the rollout ending at exactly
the target within the step cap. Role floors count only engines with a compatible peer here: from one healthy
revision the planner never needs its fallback."""
from __future__ import annotations

import pytest

from disagg.operator.rollout.simulate import RolloutStuck
from disagg.operator.rollout.state import RolloutPolicy
from support.rollout import OLD_KEY, checked_steps, rollout, scaling, sizes

MODES = {
    "new layout": rollout,
    "same layout, new revision": lambda old, new: rollout(old, new, key=OLD_KEY),
    "scaling one revision": scaling,
}
POLICIES = {
    "default": RolloutPolicy(),
    "surge 2, unavailable 1": RolloutPolicy(max_surge=2, max_unavailable=1),
    "surge 3, skew 2, at least 1 pair": RolloutPolicy(max_surge=3, max_skew=2, min_available_pairs=1),
}


WORLDS = {
    "drained engines deleted by ScaleDown": False,
    "the operator's: a drain deletes its pods": True,
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_every_size_to_every_size(mode, policy, world):
    failures, longest = [], 0
    for old in sizes():
        for new in sizes():
            try:
                steps = checked_steps(MODES[mode](old, new), POLICIES[policy], deletes_withdrawn=WORLDS[world])
                if WORLDS[world]:
                    assert not [s for s in steps if type(s).__name__ == "ScaleDown"], steps
            except (AssertionError, RolloutStuck) as e:
                failures.append(f"{old} -> {new}: {e}")
                continue
            # A swap is at most three steps (surge, drain, delete); never more swaps than engines of a role.
            if len(steps) > 3 * max(*old, *new) + 4:
                failures.append(f"{old} -> {new}: {len(steps)} steps: {steps}")
            longest = max(longest, len(steps))
    assert not failures, f"{len(failures)} of 1296 failed; first: {failures[:3]}"
    if policy == "default":
        per_swap = 2 if WORLDS[world] else 3  # surge, drain (and a ScaleDown of what was drained)
        assert longest >= (per_swap if mode.startswith("scaling") else per_swap * 5 + 1), \
            f"5P5D was replaced one pair at a time: {longest}"
