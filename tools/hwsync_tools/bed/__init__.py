"""A test and benchmark bed: N network-namespace "hosts" on one machine, rate-limited links, processes inside.

    with Bed(3, rate_bps=1e9) as bed:              # needs root, `ip` and `tc`
        p = bed.start(1, "mymodule:main", arg)     # a Python process in host 1, result back as JSON
        bed.link_down(2); bed.set_rate(0, 10e9)
        p.result(timeout=60)

Nothing of a bed lives in the machine's own network namespace; close() (also run at exit and on
SIGTERM/SIGHUP) deletes it, and a bed whose owner was SIGKILLed is swept by the next bed's start.
"""

from hwsync_tools.bed.hosts import Bed, BedError, BedUnavailableError, parse_rate, tbf_args, unavailable_reason
from hwsync_tools.bed.names import sweep
from hwsync_tools.bed.spawn import HostProcess, HostProcessError, start_in_host, wait_all

__all__ = ["Bed", "BedError", "BedUnavailableError", "HostProcess", "HostProcessError", "parse_rate", "start_in_host",
           "sweep", "tbf_args", "unavailable_reason", "wait_all"]
