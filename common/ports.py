"""A free TCP port: the one way the launchers, the tools and the tests find a
port for a rendezvous, a daemon or a server that is about to start.

The port is drawn at random from a range below Linux's ephemeral ports
(32768-60999 unless net.ipv4.ip_local_port_range says otherwise), which the
kernel hands out by itself to every outgoing connection and every bind to
port 0: a port found free below them stays free until it is used, unless a
program asks for that very number. Bottom layer: imports nothing of common/.
"""
from __future__ import annotations

import random
import socket

# Below the ephemeral ports, above most services' well-known ones; tests also aim at ranges of their own
# (the ports Slurm job ids derive, common.launcher.slurm_port).
DEFAULT_RANGE = (20000, 30000)


def free_port(low: int = DEFAULT_RANGE[0], high: int = DEFAULT_RANGE[1]) -> int:
    """A TCP port from [low, high) that nothing on this machine (in this
    network namespace) is bound to, on any of its IPv4 addresses."""
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as probe:
            try:
                # "": every address, so a daemon that listens on all of them (slurmctld) can take it too.
                probe.bind(("", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{low}, {high})")
