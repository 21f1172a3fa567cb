"""A rogue sender (a script that speaks the protocol with hwsync.protocol.encode) and a receiver that records every
mapping it makes, for tests/test_rogue_sender.py.

    python rogue_procs.py DIR CASE VICTIM OTHER_BUFFER OTHER_PARAMS

The rogue binds ipc://DIR/control, prints "endpoint ipc://DIR/control#TOKEN", answers the first
Ready with a Welcome and an Offer whose names CASE makes hostile (VICTIM: a regular file outside
/dev/shm; OTHER_*: real segments of another live process), sends a Refs frame where CASE says so,
then Done, and prints "result {json}": the frames it got back. Its own segments are real (made
by hwsync), so what it names beside the hostile one exists.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import socket
import sys
import time

import zmq

#: what each case puts where: handles' names, the doorbell's name, a Refs segment name ("" keeps the real one)
CASES = {
    "valid": {},
    "valid-doorbell": {"doorbell": ""},
    "buffer-dotdot": {"names": "../..{victim}"},
    "buffer-absolute": {"names": "{victim}"},
    "buffer-other-pid": {"names": "{other_buffer}"},
    "buffer-symlink": {"names": "{link}"},
    "doorbell-dotdot": {"doorbell": "../..{victim}"},
    "doorbell-absolute": {"doorbell": "{victim}"},
    "doorbell-symlink": {"doorbell": "{link}"},
    "doorbell-other-pid": {"doorbell": "{other_buffer}"},
    "offer-segment-other-pid": {"segments": "{other_params}"},
    "refs-dotdot": {"refs": "../..{victim}"},
    "refs-other-pid": {"refs": "{other_params}"},
    "refs-symlink": {"refs": "{params_link}"},
}


def _wait(sock: zmq.Socket, seconds: float) -> list[bytes] | None:
    return sock.recv_multipart() if sock.poll(int(seconds * 1000)) else None


def rogue(directory: str, case: str, victim: str, other_buffer: str, other_params: str) -> None:
    """Serve one receiver one hostile offer (see the module doc)."""
    import torch

    from hwsync.colocated.doorbell import Doorbell
    from hwsync.backend.owners import owner_prefix
    from hwsync.protocol import PROTOCOL_VERSION, TO_SENDER, Done, Offer, Ref, Refs, SegmentSpec, Welcome, decode, \
        encode
    from hwsync.sync.shared_params import SharedTensors, live_segments
    from hwsync.backend.shm import SHM_DIR, ShmSendBuffers

    change = CASES[case]
    links = {"link": f"{owner_prefix()}{secrets.token_hex(8)}", "params_link": f"{owner_prefix()}params-"
             f"{secrets.token_hex(8)}"}
    for name in links.values():
        os.symlink(victim, os.path.join(SHM_DIR, name))
    values = {"victim": victim, "other_buffer": other_buffer, "other_params": other_params, **links}
    buffers = ShmSendBuffers(4096, 2)
    bell = Doorbell.create(1, 2) if "doorbell" in change else None
    shared = SharedTensors([("w", torch.arange(16, dtype=torch.float32))])
    params = next(s for s in live_segments() if s.name == shared.segment_names[0])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    token = secrets.token_hex(16)
    sock.bind(f"ipc://{directory}/control")
    print(f"endpoint ipc://{directory}/control#{token}", flush=True)
    replies: list[dict] = []
    try:
        message = _wait(sock, 60)
        assert message is not None, "no receiver came"
        identity, data = message
        decode(data, TO_SENDER)
        sock.send_multipart([identity, encode(Welcome(pid=os.getpid(), host=socket.gethostname()))])
        names = buffers.handles()["names"]
        if "names" in change:
            names = [change["names"].format(**values), names[1]]
        doorbell = None if bell is None else bell.handle()
        if change.get("doorbell"):
            doorbell = {**doorbell, "name": change["doorbell"].format(**values)}
        segments = [SegmentSpec(change["segments"].format(**values), params.size)] if "segments" in change else [params]
        offer = Offer(sync=1, proto=PROTOCOL_VERSION, backend="cpu", transport="shm",
                      handles={"kind": "shm", "names": names, "bytes": 4096}, bucket_bytes=4096, num_buffers=2,
                      version=1, pid=os.getpid(), host=socket.gethostname(), manifest=None, tensors=None,
                      total_bytes=None, first=0, doorbell=doorbell, rank=0, segments=segments, delta=None)
        sock.send_multipart([identity, encode(offer)])  # encode checks nothing: a rogue sends what it likes
        while (message := _wait(sock, 10)) is not None:
            reply = json.loads(json.dumps(_raw(message[1]), default=repr))
            replies.append(reply)
            if reply.get("t") != "accept":
                break
            spec = SegmentSpec(change["refs"].format(**values), params.size) if "refs" in change else params
            refs = Refs(sync=1, segments=[spec], refs=[Ref("w", "float32", (16,), 0, 0, 64)])
            sock.send_multipart([identity, encode(refs)])
            sock.send_multipart([identity, encode(Done(sync=1, buckets=0, tensors=1, bytes=64))])
    finally:
        print("result " + json.dumps({"replies": replies}), flush=True)
        for name in links.values():
            os.unlink(os.path.join(SHM_DIR, name))
        buffers.close()
        shared.close()
        if bell is not None:
            bell.close()
        sock.close()
        ctx.term()


def _raw(data: bytes) -> dict:
    import msgpack

    return msgpack.unpackb(data, raw=False)


# -- the receiver side -------------------------------------------------------------------------------


def receive_recording(endpoint: str, q) -> None:
    """One receive(); report its error, what load saw, and every mapping made: (file, writable)."""
    mapped: list[tuple[str, bool]] = []
    real = mmap.mmap

    class Recording(real):  # every mmap this process makes, with the file it maps and whether it may write
        def __new__(cls, fd, length, *args, **kwargs):
            prot = kwargs.get("prot", mmap.PROT_READ | mmap.PROT_WRITE)
            if fd >= 0:
                mapped.append((os.readlink(f"/proc/self/fd/{fd}"), bool(prot & mmap.PROT_WRITE)))
            return super().__new__(cls, fd, length, *args, **kwargs)

    mmap.mmap = Recording
    from hwsync import WeightReceiver

    loaded: dict[str, list] = {}

    def load(pairs):
        for name, tensor in pairs:
            loaded[name] = tensor.tolist()

    receiver = WeightReceiver(endpoint, timeout_s=5)
    result: dict = {}
    try:
        receiver.receive(load)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    receiver.close()
    q.put({**result, "mapped": mapped, "loaded": loaded})


if __name__ == "__main__":
    rogue(*sys.argv[1:6])
    time.sleep(0.1)
