"""TCP keepalive for long-lived connections whose peer may vanish without closing them."""

from __future__ import annotations

import socket


def keep_alive(sock: socket.socket, idle_s: int, interval_s: int, probes: int) -> None:
    """Probe ``sock``'s peer after ``idle_s`` seconds of silence, then every ``interval_s``, and fail the connection
    after ``probes`` go unanswered: a peer whose host vanished (no FIN, no RST reaches us) is then found dead within
    ``idle_s + probes * interval_s`` seconds, where a read or a wait would otherwise last for ever."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))  # (TCP_KEEPALIVE: macOS's name)
    options = ((idle, idle_s), (getattr(socket, "TCP_KEEPINTVL", None), interval_s),
               (getattr(socket, "TCP_KEEPCNT", None), probes))
    for option, value in options:
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
