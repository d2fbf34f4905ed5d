"""jzero/fatal.py's stderr filter, fed what jaxlib writes when process 0 dies (the multi-process runs:
tests/test_multiprocess.py)."""

import subprocess
import sys

from jzero import fatal

# A process other than 0 as jaxlib 0.11.2 ends it: the preemption thread's warnings, each continued by
# lines with no glog prefix (as 0.11.2 wrote them, 2026-11-27), then the abort (its message as
# jzero/fatal.py quotes it; the filter dropped 0.11.2's) and the start of its stack.
LOST_011 = b"""W1127 01:53:23.249056   13572 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from coordination service: UNAVAILABLE: Stream removed (Socket closed)
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/GetKeyValue:
:UNAVAILABLE:Stream removed (Socket closed)
=== Source Location Trace: ===
external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89
. This is only expected if one of the tasks is unhealthy. Check the logs for the actual root cause.
E1127 01:53:23.249109   13572 preemption_sync_manager.cc:159] Failed to cancel preemption barrier: FAILED_PRECONDITION: Tried to cancel non-existent barrier PREEMPTION_SYNC_BARRIER.
=== Source Location Trace: ===
external/xla+/xla/util.h:302

F1127 01:53:23.250000   13570 client.h:77] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details.
*** Check failure stack trace: ***
    @     0x7f0000000000  absl::log_internal::LogMessageFatal::~LogMessageFatal()
"""


def _filtered(stdin: bytes) -> str:
    done = subprocess.run([sys.executable, "-S", "-c", fatal._FILTER, "lost the coordinator"], input=stdin,
                          capture_output=True, timeout=60)  # fmt: skip
    return done.stderr.decode()


def test_the_abort_and_every_line_before_it_that_jax_logged_are_one_line():
    out = _filtered(b"step 2 loss 5.1\n" + LOST_011)
    assert out == "step 2 loss 5.1\njzero: error: lost the coordinator\n", out


def test_held_lines_pass_through_in_order_when_no_abort_follows():
    """A lost-coordinator warning that no abort follows is delayed, never dropped nor reordered."""
    warning = LOST_011.split(b"F1127")[0]
    out = _filtered(b"step 1\n" + warning + b"I1127 01:53:24.000000 1 other.cc:1] later\nstep 2\n")
    assert out == (b"step 1\n" + warning + b"I1127 01:53:24.000000 1 other.cc:1] later\nstep 2\n").decode(), out
