"""Colocated weight sync: trainer and engine processes on the same host, through shared buffers (a carrier).

    # trainer process
    sender = WeightSender()                                   # binds ipc://... in a private 0700 dir
    stats = sender.send(model.state_dict().items(), version=step)

    # engine process (vLLM's worker extension does this for you)
    receiver = WeightReceiver(sender.endpoint)
    receiver.receive(load)                                    # or into=... to copy straight into your tensors

The path of a bucket, top to bottom: sender.py (WeightSender: the topology; the sync's steps are
hwsync.sync.sender's pipeline) -> carrier.py (the carrier: handshake, geometry, offer, completion,
failures) -> sender_control.py (the bound socket and its receivers) -> stream.py (pack tensors into
buckets by sync.bucket.BucketPacker's rule, the buffer pool, the links) -> doorbell.py (tell receivers
a bucket is ready, learn it was released) -> receiver.py (views, reassembly or into=, release).
The buffers themselves are the backend's Transport (shared memory, CUDA IPC, NPU IPC); the frames
are hwsync.protocol's.
"""

from __future__ import annotations

from hwsync.colocated.receiver import WeightReceiver
from hwsync.colocated.sender import WeightSender

__all__ = ["WeightReceiver", "WeightSender"]
