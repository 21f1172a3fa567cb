"""How large a frame may be, by who sends it: every socket refuses more (ZMQ_MAXMSGSIZE).

The limits are what the frames themselves need, so a socket never buffers more than one
legitimate frame's worth from anyone:
- a receiver (or a collective rank) sends small frames: a Ready with its reported state, an
  Accept, a Release, a Complete with its figures, an Error whose message is cut to
  MAX_MESSAGE_CHARS. The sender's and the hub's sockets, which anyone who can reach the address
  may connect to, take at most MAX_PEER_FRAME_BYTES per message.
- a sender (or the hub) sends the manifest in its Offer (PlanFrame: the manifest and every
  bucket's entries), so its frames grow with the number of tensors: MAX_SENDER_FRAME_BYTES holds
  about half a million tensors with 60-character names. A bigger manifest is refused on the
  sending side with an error saying so, before anything is sent.
A frame over its limit is refused by the sending side with an error naming the limit; one that
arrives anyway (a stranger's) makes ZeroMQ drop that connection before the bytes are read.
"""

from __future__ import annotations

from hwsync.errors import ProtocolError

#: the largest frame a receiver or collective rank may send (the sender's and hub's ZMQ_MAXMSGSIZE)
MAX_PEER_FRAME_BYTES = 256 << 10
#: the largest frame a sender or hub may send: an Offer or PlanFrame with its manifest (receivers' ZMQ_MAXMSGSIZE)
MAX_SENDER_FRAME_BYTES = 64 << 20
#: an error or refusal message is cut to this many characters before it travels
MAX_MESSAGE_CHARS = 8 << 10
#: messages a bound socket queues per connected peer before it stops reading from that peer (ZMQ_RCVHWM): a
#: stranger can park at most this many frames; a receiver that reaches it only waits (nothing is lost)
PEER_QUEUE_FRAMES = 64


def cut(message: str) -> str:
    """A message short enough for an Error, Abort or Refused frame."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 20] + f" ... ({len(message)} chars)"


def check_size(data: bytes, limit: int, what: str) -> bytes:
    """`data` if it fits `limit`, else ProtocolError naming the frame, its size and the limit."""
    if len(data) > limit:
        raise ProtocolError(f"{what} takes {len(data)} bytes on the wire, over the protocol's {limit}-byte limit "
                            "(hwsync.protocol.limits); send fewer or shorter-named tensors per sync, or less state")
    return data
