"""A stranger: a process that connects to a sender's (or hub's) control socket without the token.

    python stranger_procs.py ADDRESS SOCKET MODE SECONDS [KEY]

ADDRESS is the bound address (no token); KEY, when given, the server's CURVE public key in hex
(a stranger that learnt the public key, but not the token); a tcp:// ADDRESS without KEY is a
stranger that does not even have the key. SOCKET is "dealer" or "req". The messages to send
come on stdin: a msgpack list of multipart messages (lists of bytes; [b"zeros", b"SIZE"] is one
frame of SIZE zero bytes, made by the stranger). MODE:
- burst: send each message once, wait SECONDS for them to be delivered, exit;
- repeat: send them again and again (every 5 ms) for SECONDS, then exit;
- silent: connect and send nothing for SECONDS.
Prints "connected" once the socket is set up (before sending). Imports no torch and no hwsync.
"""

from __future__ import annotations

import sys
import time

import msgpack
import zmq
from zmq.utils import z85


def main() -> None:
    address, kind, mode, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    key = sys.argv[5] if len(sys.argv) > 5 else None
    messages = [[bytes(p) for p in m] for m in msgpack.unpackb(sys.stdin.buffer.read(), raw=False)]
    zeros: dict[int, bytes] = {}  # [b"zeros", b"SIZE"] stands for one frame of SIZE zero bytes (made here, once)
    messages = [[zeros.setdefault(int(m[1]), bytes(int(m[1])))] if m[0] == b"zeros" else m for m in messages]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ if kind == "req" else zmq.DEALER)
    sock.setsockopt(zmq.LINGER, int(seconds * 1000))
    if key:
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = z85.encode(bytes.fromhex(key))
    sock.connect(address)
    print("connected", flush=True)
    end = time.monotonic() + seconds
    if mode == "silent":
        time.sleep(seconds)
    elif mode == "burst":
        for message in messages:
            sock.send_multipart(message, copy=False)
            if kind == "req":
                break  # a REQ socket sends one request, then must wait for a reply
    else:
        while time.monotonic() < end:
            for message in messages:
                try:
                    sock.send_multipart(message, copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:  # the sender is not reading now: keep trying until the time is up
                    pass
            time.sleep(0.005)
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main()
