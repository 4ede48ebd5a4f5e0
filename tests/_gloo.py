"""A teardown race of gloo on CPU, outside hookscope's control, for the tests that run torchrun.

On a quiet machine, a rank that has finished all its work (training, log, report, and
``destroy_process_group()``) sometimes aborts at exit with "terminate called without an active
exception" (exit -6), when the ranks shut down at nearly the same moment; seen in clean-clone CI
runs of this suite, never under load. Those tests run the command again, once, on exactly that
message; any other failure fails them, and a second abort too.
"""

from __future__ import annotations

TEARDOWN_ABORT = "terminate called without an active exception"


def teardown_abort(stderr: str) -> bool:
    return TEARDOWN_ABORT in stderr
