"""The DisaggregatedRole objects (operator/scale/objects.py): what is created, what an update sends, what is read
back, and the status /scale reports."""
from __future__ import annotations

from disagg.operator import names
from disagg.operator.api import RevisionRoleStatus, RevisionStatus
from disagg.operator.builders import build_children
from disagg.operator.role_api import SPEC_REPLICAS_ANNOTATION, DisaggregatedRole, DisaggregatedRoleStatus
from disagg.operator.scale.counts import LiveRole, RoleWrite
from disagg.operator.scale.objects import live_role, role_object, role_status, role_update, selector
from support.crs import UID, make_cr, statefulset

OWNER = [{"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference", "name": "qwen", "uid": UID,
          "controller": True, "blockOwnerDeletion": True}]


def test_a_role_object_is_named_for_its_role_owned_by_the_cr_and_records_the_spec_value():
    obj = role_object(make_cr(), "decode", RoleWrite(3, 2))
    assert obj["kind"] == "DisaggregatedRole" and obj["metadata"]["name"] == "qwen-decode"
    assert obj["metadata"]["namespace"] == "ml" and obj["metadata"]["ownerReferences"] == OWNER
    assert obj["metadata"]["labels"][names.LABEL_INSTANCE] == "qwen"
    assert obj["metadata"]["labels"][names.LABEL_COMPONENT] == "decode"
    assert obj["metadata"]["annotations"] == {SPEC_REPLICAS_ANNOTATION: "2"}
    assert obj["spec"] == {"deployment": "qwen", "role": "decode", "replicas": 3}
    DisaggregatedRole.model_validate(obj)  # what the CRD's schema is generated from
    unset = role_object(make_cr(), "prefill", RoleWrite(1, None))
    assert "annotations" not in unset["metadata"], "nothing copied yet: no record"


def test_an_update_is_conditional_on_the_object_read_and_takes_ownership():
    patch = role_update(make_cr(), "decode", RoleWrite(2, 2, "41"))
    assert patch["metadata"]["resourceVersion"] == "41", "the apiserver refuses it (409) if the object changed"
    assert patch["spec"] == {"replicas": 2}, "only the count: deployment and role are immutable"
    assert patch["metadata"]["ownerReferences"] == OWNER
    assert patch["metadata"]["annotations"] == {SPEC_REPLICAS_ANNOTATION: "2"}
    cleared = role_update(make_cr(), "decode", RoleWrite(2, None, "41"))
    assert cleared["metadata"]["annotations"] == {SPEC_REPLICAS_ANNOTATION: None}, "merge patch: null removes it"


def test_a_role_object_reads_back_as_written():
    obj = role_object(make_cr(), "decode", RoleWrite(3, 2))
    obj["metadata"].update(resourceVersion="9", generation=2)
    obj["status"] = {"replicas": 3, "readyReplicas": 2, "selector": "x=y"}
    assert live_role(obj) == LiveRole("qwen-decode", 3, 2, "9", 2, UID,
                                      DisaggregatedRoleStatus(replicas=3, ready_replicas=2, selector="x=y"))
    obj["metadata"]["annotations"][SPEC_REPLICAS_ANNOTATION] = "not a number"
    del obj["metadata"]["ownerReferences"]
    read = live_role(obj)
    assert read.spec_replicas is None and read.owner_uid is None


def test_the_selector_matches_every_revisions_engine_pods_of_the_role_and_only_them():
    children = build_children(make_cr())
    for role in ("prefill", "decode"):
        terms = dict(t.split("=") for t in selector("qwen", role).split(","))
        labels = statefulset(children, role)["spec"]["template"]["metadata"]["labels"]
        assert terms.items() <= labels.items()
        assert names.LABEL_REVISION not in terms, "a rollout's old and new engines both count"
        other = statefulset(children, "prefill" if role == "decode" else "decode")
        assert not terms.items() <= other["spec"]["template"]["metadata"]["labels"].items()


def test_the_status_counts_the_role_in_every_revision():
    revisions = [RevisionStatus(name="aaaaaa", decode=RevisionRoleStatus(replicas=2, ready=1, advertised=1)),
                 RevisionStatus(name="bbbbbb", current=True, prefill=RevisionRoleStatus(replicas=1, ready=1),
                                decode=RevisionRoleStatus(replicas=1, ready=1, advertised=0))]
    status = role_status("qwen", "decode", 5, revisions)
    assert status == DisaggregatedRoleStatus(observed_generation=5, replicas=3, ready_replicas=2,
                                             selector="app.kubernetes.io/component=decode,"
                                                      "app.kubernetes.io/instance=qwen")
