"""Which of a CR's own watch events start a full pass (operator/generations.py)."""
from __future__ import annotations

from disagg.operator.generations import Generations

KEY = ("ml", "m")


def test_a_cr_found_at_start_up_gets_one_pass_and_a_relisting_of_it_none():
    g = Generations()
    assert g.trigger(KEY, None, "u1", 3) == "resume"
    assert g.trigger(KEY, None, "u1", 3) is None, "a watch that re-lists shows nothing new"
    assert g.trigger(KEY, None, "u1", 4) == "resume", "a spec changed while the watch was down"


def test_one_pass_per_generation_none_for_status_writes():
    g = Generations()
    assert g.trigger(KEY, "ADDED", "u1", 1) == "create"
    assert g.trigger(KEY, "MODIFIED", "u1", 1) is None, "a status write keeps the generation"
    assert g.trigger(KEY, "MODIFIED", "u1", 2) == "update"
    assert g.trigger(KEY, "MODIFIED", "u1", 2) is None


def test_a_cr_recreated_under_the_same_name_is_a_creation():
    g = Generations()
    assert g.trigger(KEY, "ADDED", "u1", 1) == "create"
    assert g.trigger(KEY, "ADDED", "u2", 1) == "create", "a new uid, even if its DELETED event was missed"
    g.forget(KEY)
    assert g.trigger(KEY, "ADDED", "u2", 1) == "create"
