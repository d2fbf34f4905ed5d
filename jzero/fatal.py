"""JAX's fatal abort when process 0 dies, as one line.

When process 0 of a multi-process run dies, the coordination service goes with it and JAX ends
every other process at once from C++ (`client.h`: "Terminating process because the JAX distributed
service detected fatal errors"), followed by a 16-line abort stack; no Python runs there (jaxlib
0.10's hook for it fails with `std::bad_cast`). So a process other than 0 routes its stderr (fd 2)
through a small filter process, which passes everything through as it comes (a progress bar's
partial lines included) until it sees that abort: it drops the abort and its stack and writes one
line naming the coordinator instead. The filter ignores SIGINT and SIGTERM (it must outlive the run
to write that line) and ends when the run's stderr closes, i.e. when the process has exited.
The process still ends by SIGABRT (exit 134 in a shell).
"""

from __future__ import annotations

import os
import subprocess
import sys

_FILTER = r"""
import os, re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
glog = re.compile(rb"^[EFWI]\d{4} ")  # a C++ log line, which may be the abort's start: held until whole
# What JAX logs as it loses the coordinator, before the abort (the polling thread's error, or the
# preemption-notice thread's, with gRPC's detail lines), in whichever order its threads see it
LOST = (b"Polled an error from coordination service", b"preemption_sync_manager", b"Additional GRPC error information",
        b"Error received from peer")
fatal, held, pending = False, b"", b""

def write(data):
    try:
        os.write(2, data)
    except OSError:
        pass

while True:
    chunk = os.read(0, 65536)
    if not chunk:
        break
    if fatal:
        continue
    pending += chunk
    *lines, pending = pending.split(b"\n")
    for line in lines:
        if b"JAX distributed service detected fatal errors" in line:
            fatal = True
            break
        # the abort's first lines, and the lines that continue one (no glog prefix: jaxlib 0.11's
        # "=== Source Location Trace: ===" and its file lines): held until it is known
        if any(part in line for part in LOST) or (held and not glog.match(line)):
            held += line + b"\n"
            continue
        write(held + line + b"\n")
        held = b""
    if not fatal and pending and not held and not glog.match(pending):
        write(pending)
        pending = b""
write(("jzero: error: " + sys.argv[1] + "\n").encode() if fatal else held + pending)
"""


def one_line_abort(message: str) -> None:
    """Routes this process's stderr through the filter (module docstring); JAX's abort becomes
    `jzero: error: <message>`."""
    read, write = os.pipe()
    subprocess.Popen([sys.executable, "-S", "-c", _FILTER, message], stdin=read, stdout=subprocess.DEVNULL)
    os.close(read)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)
