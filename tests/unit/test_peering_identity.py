"""The operator's kopf peering identity does not depend on a passwd entry for its uid (the image runs as 65532,
which has none; kopf's default identity called getpass.getuser() and the operator pod died at start)."""
from __future__ import annotations

import getpass
from datetime import UTC, datetime

from disagg.operator.peering import own_identity


def test_identity_names_the_pod_and_needs_no_user_name(monkeypatch):
    def no_passwd_entry() -> str:  # a fake of a uid without a passwd entry: what getpwuid raises
        raise KeyError("getpwuid(): uid not found: 65532")

    monkeypatch.setattr(getpass, "getuser", no_passwd_entry)
    when = datetime(2026, 12, 1, 5, 30, 0, tzinfo=UTC)
    a = own_identity({"POD_NAME": "disagg-operator-7f9c-abcde"}, when)
    b = own_identity({"POD_NAME": "disagg-operator-7f9c-abcde"}, when)
    assert a.startswith("disagg-operator-7f9c-abcde/20261201053000/")
    assert a != b  # a restarted replica never takes over its predecessor's peering record


def test_identity_falls_back_to_the_host_name():
    import socket

    assert own_identity({}).startswith(socket.gethostname() + "/")
