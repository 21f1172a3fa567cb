"""Timing defaults: every timeout and polling interval hwsync uses, named and explained once.

Timeouts bound how long a side waits for a silent peer; slices are how often a wait wakes up to
look at something else (a peer process that may have died, a deadline, a ping to answer).
Callers override the timeouts per object (`timeout_s=`); the slices are fixed because they
trade a little CPU for how fast a failure is noticed, not correctness.
"""

from __future__ import annotations

#: how long a sync waits for a silent peer (sender, receiver, collective rank) before it fails
DEFAULT_TIMEOUT_S = 60.0
#: how long forming a process group may take: every rank must reach the rendezvous
GROUP_TIMEOUT_S = 300.0
#: how often a ZeroMQ wait wakes up to check that a same-host peer process still exists
LIVENESS_SLICE_S = 0.5
#: how often the disaggregated control loop polls its socket, worker results and deadlines
CONTROL_SLICE_S = 0.25
#: how often LocalForwarder looks at its deadline while the local sync takes a tensor
FORWARD_SLICE_S = 0.2
#: doorbell waits: spin, then check for failures (error frames, dead peers) this soon ...
DOORBELL_FIRST_CHECK_S = 0.002
#: ... and this often after (a non-blocking poll and a /proc read: cheap at this rate)
DOORBELL_CHECK_S = 0.005
#: while packing, how often the sender reads its socket: errors, close(), receivers that exited or were refused
PACKING_CHECK_S = 0.005
#: the longest sleep between doorbell checks once spinning has stopped paying
DOORBELL_MAX_SLEEP_S = 1e-3
#: how long a collective worker thread gets to finish its queue when its group is dropped
WORKER_JOIN_S = 2.0
#: the same, when the group is dropped because its sync failed: a collective stuck on a dead or stalled
#: peer ends only at the group's own timeout however long we wait, and the caller must hear of the
#: failure before that (the thread is abandoned; it ends at that timeout)
FAILED_JOIN_S = 0.25
#: extra time the trainer gives the engine's receive call after its own side finished
RPC_GRACE_S = 30.0
#: how long close() called from another thread waits for a running sync to send its abort and end
CLOSE_GRACE_S = 5.0
#: how long closing a socket waits to deliver what was just sent on it: a sender's abort to live receivers
CLOSE_LINGER_S = 0.5
#: the same after a failure: a last error frame must reach the other side (the hub, the sender) before the socket goes
ERROR_LINGER_S = 1.0
#: a peer whose frames are dropped (no token, malformed) is logged at most once per this many seconds
DROP_LOG_INTERVAL_S = 10.0

#: the bed's plain TCP stream (hwsync_tools.bed.stream): how long one attempt to connect to its sink may take ...
BED_CONNECT_ATTEMPT_S = 2.0
#: ... and the pause between attempts while the sink is still starting
BED_CONNECT_RETRY_S = 0.05
