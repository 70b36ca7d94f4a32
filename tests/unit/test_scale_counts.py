"""Which count a role runs (operator/scale/counts.py): the CR's spec.<role>.replicas only when it changes, else the
role object's (what /scale set). Table tests for each case, then properties over every state."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.operator.api import DisaggregatedInferenceStatus, RoleStatus
from disagg.operator.scale.counts import LiveRole, Remembered, RoleScale, RoleWrite, decide, kept, remembered

UID = "cr-uid"


def live(replicas: int, record: int | None, owner: str | None = UID, rv: str = "7") -> LiveRole:
    return LiveRole("m-decode", replicas, record, rv, 3, owner)


CASES = [
    # (what happens, spec.decode.replicas, the role object, the CR's status, count, record, write)
    ("a new CR: created at spec.decode.replicas", 2, None, None, 2, 2, RoleWrite(2, 2)),
    ("a new CR without replicas: created at 1, nothing recorded", None, None, None, 1, None, RoleWrite(1, None)),
    ("an autoscaled count, the manifest applied again: kept", 1, live(3, 1), Remembered(3, 1), 3, 1, None),
    ("an edit of replicas in the manifest: copied, on the object read", 2, live(3, 1), Remembered(3, 1), 2, 2,
     RoleWrite(2, 2, "7")),
    ("replicas removed from the manifest: the count is kept", None, live(3, 1), Remembered(3, 1), 3, 1, None),
    ("the same value put back after removing it: unchanged, kept", 1, live(3, 1), Remembered(3, 1), 3, 1, None),
    ("scaled to 0 by a scaler: kept (the CR's validation allows 0)", 1, live(0, 1), Remembered(1, 1), 0, 1, None),
    ("a user deleted the role object: recreated at its last count", 1, None, Remembered(3, 1), 3, 1, RoleWrite(3, 1)),
    ("deleted while replicas changed: recreated at the new value", 2, None, Remembered(3, 1), 2, 2, RoleWrite(2, 2)),
    ("deleted, no replicas in the manifest: its last count", None, None, Remembered(3, None), 3, None,
     RoleWrite(3, None)),
    ("upgraded from an operator without role objects: the spec", 4, None, Remembered(2, None), 4, 4,
     RoleWrite(4, 4)),
    ("an object that lost its record: the status' record is written back", 1, live(3, None), Remembered(3, 1), 3, 1,
     RoleWrite(3, 1, "7")),
    ("a role object a user made: adopted at its count", 1, live(5, None, owner=None), Remembered(1, 1), 5, 1,
     RoleWrite(5, 1, "7")),
    ("a user's role object, replicas changed meanwhile: the change wins", 2, live(5, None, owner=None),
     Remembered(1, 1), 2, 2, RoleWrite(2, 2, "7")),
    ("an earlier CR's role object, being collected: not written", 2, live(5, 5, owner="old-uid"), None, 2, 2, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_which_count_a_role_runs(case):
    _, asked, obj, memory, count, record, write = case
    scale = decide("decode", asked, obj, memory, UID)
    assert (scale.desired, scale.spec_replicas, scale.write) == (count, record, write)
    assert (scale.write is None) == (scale.reason == "" or obj is not None and obj.owner_uid not in (None, UID))


def test_reasons_say_what_happened():
    assert decide("decode", 2, live(3, 1), None, UID).reason == "spec.decode.replicas changed from 1 to 2"
    assert decide("prefill", None, None, None, UID).reason == "at 1 (spec.prefill.replicas unset)"
    assert decide("decode", 1, None, Remembered(3, 1), UID).reason == "at 3, the count the role last ran"
    assert "controlled by another object" in decide("decode", 1, live(2, 2, owner="x"), None, UID).reason


def test_the_status_remembers_only_once_published():
    assert remembered(None, "decode") is None
    assert remembered(DisaggregatedInferenceStatus(), "decode") is None, "never reconciled: no observedGeneration"
    status = DisaggregatedInferenceStatus(observed_generation=4, decode=RoleStatus(desired=3, spec_replicas=1))
    assert remembered(status, "decode") == Remembered(3, 1)
    assert remembered(status, "prefill") == Remembered(0, None)


def test_a_refused_write_keeps_what_the_object_says_and_a_refused_create_runs_the_decision():
    copy = decide("decode", 2, live(3, 1), None, UID)
    assert kept(copy, live(3, 1), None) == RoleScale("decode", 3, 1), "the copy is tried again next pass"
    create = decide("decode", 2, None, None, UID)
    assert kept(create, None, None) == RoleScale("decode", 2, 2), "no role object (no CRD): the spec still rules"


counts = st.integers(0, 1000)
records = st.none() | counts
owners = st.sampled_from([UID, None, "other-uid"])
objects = st.none() | st.builds(live, counts, records, owners)
memories = st.none() | st.builds(Remembered, counts, records)


def _after(scale: RoleScale, obj: LiveRole | None) -> LiveRole:
    """The role object once `scale`'s write is done."""
    assert scale.write is not None
    return LiveRole("m-decode", scale.write.replicas, scale.write.spec_replicas, "8", 4, UID)


@given(asked=records, obj=objects, memory=memories)
def test_a_write_once_done_is_not_repeated(asked, obj, memory):
    scale = decide("decode", asked, obj, memory, UID)
    if scale.write is None:
        return
    assert scale.write.replicas == scale.desired and scale.write.spec_replicas == scale.spec_replicas
    assert scale.write.resource_version == (None if obj is None else obj.resource_version)
    again = decide("decode", asked, _after(scale, obj), memory, UID)
    assert again.write is None and again.desired == scale.desired


@given(obj=st.builds(live, counts, records, st.sampled_from([UID, None])), memory=memories, drop=st.booleans())
def test_applying_the_manifest_again_never_changes_a_count(obj, memory, drop):
    """The manifest as last copied (the record), or without replicas: the role object's count stands."""
    record = obj.spec_replicas if obj.spec_replicas is not None else (memory.spec_replicas if memory else None)
    scale = decide("decode", None if drop else record, obj, memory, UID)
    assert scale.desired == obj.replicas


@given(asked=counts, obj=objects, memory=memories)
def test_a_changed_replicas_wins_at_once(asked, obj, memory):
    record = obj.spec_replicas if obj is not None and obj.owner_uid in (None, UID) and obj.spec_replicas is not None \
        else (memory.spec_replicas if memory else None)
    scale = decide("decode", asked, obj, memory, UID)
    if asked != record:
        assert scale.desired == asked and scale.spec_replicas == asked


@given(asked=records, obj=st.builds(live, counts, records, st.just("other-uid")), memory=memories)
def test_another_objects_role_object_is_never_written(asked, obj, memory):
    assert decide("decode", asked, obj, memory, UID).write is None
