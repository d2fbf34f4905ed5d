"""jzero/peers.py's step watchdog, on process 0's clock alone (no processes): with the default config a
multi-process run whose processes are all alive but complete no step stops after 30 minutes."""

from jzero.config import DistributedConfig
from jzero.peers import Monitor


def test_the_default_watchdog_stops_a_stuck_run_after_30_minutes():
    monitor = Monitor(None, 0, 2, "127.0.0.1:1", DistributedConfig())
    monitor.progress = {0: {"steps": 3, "phase": "step"}, 1: {"steps": 2, "phase": "step"}}
    assert monitor._stuck(100.0) is None  # the clock starts with the steps
    assert monitor._stuck(100.0 + 1800) is None
    assert monitor._stuck(100.0 + 1801) == (
        "no process completed a step in 1800 s (distributed.step_timeout_s); the slowest, process 1 of 2, "
        "has completed 2 and is in step"
    )
    monitor.progress[1] = {"steps": 3, "phase": "step"}
    monitor.progress[0] = {"steps": 4, "phase": "save"}  # a step completed: the clock starts again
    assert monitor._stuck(100.0 + 1802) is None and monitor._stuck(100.0 + 3601) is None


def test_zero_turns_it_off():
    monitor = Monitor(None, 0, 2, "127.0.0.1:1", DistributedConfig(step_timeout_s=0))
    monitor.progress = {1: {"steps": 0, "phase": "step"}}
    assert monitor._stuck(0.0) is None and monitor._stuck(1e9) is None
