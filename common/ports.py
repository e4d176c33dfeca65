"""A free TCP port: the one way the launchers, the tools and the tests find a
port for a rendezvous, a daemon or a server that is about to start.

The port is drawn at random from 30000-32767: below Linux's ephemeral ports
(32768-60999 unless net.ipv4.ip_local_port_range says otherwise), which the
kernel hands out by itself to every outgoing connection and every bind to
port 0, so a port found free there stays free until it is used, unless a
program asks for that very number; and above the ports Slurm jobs derive
from their job ids (common.launcher.slurm_port: 10000-29999), so a plain run
on a shared node never takes the port a co-located Slurm job will ask for.
Bottom layer: imports nothing of common/.
"""
from __future__ import annotations

import random
import socket

# Between the ports Slurm job ids derive and the ephemeral ones (above); tests also aim at ranges of their own
# (the Slurm-derived ones, to check a clash is said).
DEFAULT_RANGE = (30000, 32768)


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
