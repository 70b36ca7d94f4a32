"""The operator's log: kopf's line per watch event only with --verbose; failures always."""
import logging

import pytest

from disagg.operator.run import configure_logging


@pytest.fixture(autouse=True)
def restore_levels():
    names = ("", "kopf.objects", "httpx", "httpx2", "httpcore")  # "": the root logger
    before = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in before.items():
        logging.getLogger(n).setLevel(level)


def test_handler_successes_are_not_logged_but_failures_are():
    configure_logging(verbose=False)
    objects = logging.getLogger("kopf.objects")
    assert not objects.isEnabledFor(logging.INFO)  # "Handler 'engine_pod_event' succeeded." per pod event
    assert objects.isEnabledFor(logging.WARNING) and objects.isEnabledFor(logging.ERROR)


def test_verbose_shows_them():
    logging.getLogger().setLevel(logging.DEBUG)  # what basicConfig sets on a fresh process with --verbose
    configure_logging(verbose=True)
    assert logging.getLogger("kopf.objects").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
