"""Size and queue bounds for every specserve ZeroMQ socket.

Without them a peer decides how much memory we spend on it: ZeroMQ accepts a message of any
size (it allocates what the header claims) and queues without limit where a high-water mark is
0. `MAXMSGSIZE` makes a larger inbound message drop its connection; the high-water marks bound
each peer's queue, in messages, in both directions.
"""

from __future__ import annotations

import zmq

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # the control plane's inbound limit (`--max-message-bytes`)
# A client receives a whole non-streaming completion in one message, logprobs included: up to
# ~300 bytes per token, so a few hundred thousand tokens.
CLIENT_MAX_MESSAGE_BYTES = 256 << 20
DEFAULT_HWM = 100_000  # messages queued per peer and direction (`--socket-hwm`)


def bound_socket(sock: zmq.Socket, max_message_bytes: int, hwm: int = DEFAULT_HWM) -> None:
    """Refuse inbound messages over `max_message_bytes`; queue at most `hwm` per peer."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)


def worker_max_message_bytes(max_num_seqs: int, max_model_len: int, num_kv_groups: int) -> int:
    """The largest step batch a worker can be sent: every sequence arriving in full (token ids
    and one block id per token and KV group at worst, 9 bytes each), plus the envelope."""
    per_token = 9 * (1 + num_kv_groups)
    return DEFAULT_MAX_MESSAGE_BYTES + max_num_seqs * max_model_len * per_token
