"""A process that cannot join the process group says why, in its one error line: while joining,
common.rendezvous holds back what c10d writes to stderr (every failed attempt, with a C++ stack), and
on a failure it quotes the lines of it that say why (an errno, a name that does not resolve),
condensed. The logs below are c10d's own (PyTorch 2.14), stack frames cut short."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from common import cli
from common.launcher import Launch
from common.rendezvous import RendezvousError, join_log_causes, join_process_group
from helpers import REPO, free_port

# rank 1 of 2, node 0 named no-such-node.invalid: what stays when the name does not resolve
UNRESOLVED_LOG = """\
[W1125 14:32:47.926752244 socket.cpp:764] [c10d] The IPv6 network addresses of (no-such-node.invalid, 29911) \
cannot be retrieved (gai error: -2 - Name or service not known).
[W1125 14:32:48.651063921 socket.cpp:764] [c10d] The IPv6 network addresses of (no-such-node.invalid, 29911) \
cannot be retrieved (gai error: -2 - Name or service not known).
[E1125 14:32:49.479429168 socket.cpp:1028] [c10d] The client socket has timed out after 3000ms while trying to \
connect to (no-such-node.invalid, 29911).
[W1125 14:32:49.479715375 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host \
no-such-node.invalid:29911 - retrying (try=0, timeout=3000ms, delay=1982ms): The client socket has timed out after \
3000ms while trying to connect to (no-such-node.invalid, 29911).
Exception raised from throwTimeoutError at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/socket.cpp:1030 (most \
recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char>) + 0x9d (0x7f72bc55e60d in libc10.so)
<omitting python frames>

[E1125 14:32:51.475731681 TCPStore.cpp:328] [c10d] TCP client failed to connect/validate to host \
no-such-node.invalid:29911 - timed out (try=1, timeout=3000ms): The client socket has timed out after 3000ms while \
trying to connect to (no-such-node.invalid, 29911).
"""
UNRESOLVED_SUMMARY = ("The client socket has timed out after 3000ms while trying to connect to "
                      "(no-such-node.invalid, 29911).")

# rank 0, port held by another program, USE_LIBUV=0 (the store PyTorch used before 2.4)
PORT_IN_USE_LOG = """\
[W1125 14:44:59.348074900 socket.cpp:525] [c10d] The server socket has failed to bind to [::]:53655 (errno: 98 - \
Address already in use).
[W1125 14:44:59.348101119 socket.cpp:525] [c10d] The server could not be initialized on any address for \
port=53655, family=10
[W1125 14:44:59.352829940 socket.cpp:525] [c10d] The server socket has failed to bind to 0.0.0.0:53655 (errno: 98 - \
Address already in use).
[E1125 14:44:59.352861429 socket.cpp:561] [c10d] The server socket has failed to listen on any local network address.
"""

# rank 1 of 2 with TORCH_CPP_LOG_LEVEL=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL, nothing listening at node 0 yet
REFUSED_INFO_LOG = """\
[I1125 14:42:35.796119189 socket.cpp:859] [c10d - trace] The client socket is attempting to connect to \
[::ffff:127.0.0.1]:29911.
[I1125 14:42:35.800821019 socket.cpp:931] [c10d - trace] The server socket on [::ffff:127.0.0.1]:29911 is not yet \
listening (errno: 111 - Connection refused), will retry.
[I1125 14:42:38.765642508 socket.cpp:931] [c10d - trace] The server socket on [::ffff:127.0.0.1]:29911 is not yet \
listening (errno: 111 - Connection refused), will retry.
[I1125 14:45:09.086168337 TCPStoreLibUvBackend.cpp:1354] [c10d] uv_loop_close failed with:-16 errn:EBUSY desc:resource \
busy or locked
[I1125 14:45:09.086275047 TCPStoreLibUvBackend.cpp:1364] [c10d] uv_loop cleanup finished.
"""


def test_the_log_lines_that_say_why_are_kept_once_and_the_rest_dropped():
    assert join_log_causes(UNRESOLVED_LOG, UNRESOLVED_SUMMARY) == [
        "The IPv6 network addresses of (no-such-node.invalid, 29911) cannot be retrieved "
        "(gai error: -2 - Name or service not known)."]
    assert join_log_causes(PORT_IN_USE_LOG, "The server socket has failed to listen on any local network address.") == [
        "The server socket has failed to bind to [::]:53655 (errno: 98 - Address already in use).",
        "The server socket has failed to bind to 0.0.0.0:53655 (errno: 98 - Address already in use).",
        "The server could not be initialized on any address for port=53655, family=10"]
    assert join_log_causes(REFUSED_INFO_LOG, "Timed out") == [
        "The server socket on [::ffff:127.0.0.1]:29911 is not yet listening (errno: 111 - Connection refused), "
        "will retry."]
    assert join_log_causes("", "Timed out after 4 seconds waiting for clients. 1/2 clients joined.") == []
    # PyTorch before 2.4 logged without the date, and said "Connection refused" at the default level.
    assert join_log_causes("[W socket.cpp:601] [c10d] The client socket has failed to connect to [node0]:29500 "
                           "(errno: 111 - Connection refused).\n", "Socket Timeout") == [
        "The client socket has failed to connect to [node0]:29500 (errno: 111 - Connection refused)."]


def srun_task(rank: int, world_size: int, url: str) -> Launch:
    """What common.launcher.discover makes of `srun` with one task per GPU and --dist-url `url`."""
    return Launch(launcher="slurm", init_method=url, world_size=world_size, nodes=1, node_rank=0,
                  procs_per_node=world_size, rank=rank, local_rank=rank)


@pytest.fixture
def cpu_threads_kept():
    """Joining sets the process's CPU threads (its share of the node's cores): give pytest's back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_port_in_use_at_the_join_fails_at_once_and_names_the_flag_that_changes_it(cpu_threads_kept):
    # Under srun each task joins by itself (no launching process checks the port first), and rank 0 hosts the store.
    cfg = cli.parse("ddp", ["--synthetic", "--device", "cpu", "--dist-timeout", "30"])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(RendezvousError) as raised:
            join_process_group(cfg, srun_task(0, 1, f"tcp://127.0.0.1:{port}"), rank=0, local_rank=0)
    assert time.monotonic() - began < 10  # at once, not after --dist-timeout
    message = str(raised.value)
    assert message.startswith(f"could not join the process group of 1 processes at tcp://127.0.0.1:{port}: "
                              f"its port is in use on this node (")
    assert "address already in use" in message.lower() and message.endswith(
        "; choose a free one with --dist-url tcp://HOST:PORT"), message
    assert "--dist-timeout" not in message and "\n" not in message


def test_a_node_zero_name_that_does_not_resolve_is_said_in_the_error(cpu_threads_kept):
    cfg = cli.parse("ddp", ["--synthetic", "--device", "cpu", "--dist-timeout", "1"])
    with pytest.raises(RendezvousError) as raised:
        join_process_group(cfg, srun_task(1, 2, f"tcp://no-such-node.invalid:{free_port()}"), rank=1, local_rank=1)
    message = str(raised.value)
    assert message.startswith("could not join the process group of 2 processes at tcp://no-such-node.invalid:")
    # Without this, only "timed out ... trying to connect to (no-such-node.invalid, PORT)": it does not say why.
    assert "network addresses of (no-such-node.invalid," in message and "gai error" in message, message
    assert "within --dist-timeout 1 s" in message and "\n" not in message


@pytest.mark.slow
def test_a_rendezvous_that_never_completes_quotes_connection_refused_from_cs_log():
    """imagenet_ddp.py as rank 1 of 2 under srun, node 0 never started, c10d's detailed log switched
    on (as docs/launching.md tells a user looking for the cause): the one error line says the
    connection was refused."""
    port = free_port()
    env = dict(os.environ, SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NUM_NODES="1",
               SLURM_JOB_ID="77", SLURM_JOB_NODELIST="localhost", CUDA_VISIBLE_DEVICES="", TORCH_CPP_LOG_LEVEL="INFO",
               TORCH_DISTRIBUTED_DEBUG="DETAIL")
    result = subprocess.run([sys.executable, REPO / "imagenet_ddp.py", "--synthetic", "--device", "cpu", "-a",
                             "resnet18", "--dist-url", f"tcp://127.0.0.1:{port}", "--dist-timeout", "2"],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    # The log asked for goes on stderr too (glog lines, "[I1125 14:46:42.095858071 debug.cpp:48] ..."); one error line.
    errors = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[I")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith(f"imagenet_ddp.py: error: rank 1: could not join the process group of 2 processes "
                                f"at tcp://127.0.0.1:{port} within --dist-timeout 2 s ("), errors[0]
    assert (f"; c10d logged: The server socket on [::ffff:127.0.0.1]:{port} is not yet listening "
            f"(errno: 111 - Connection refused), will retry); check that every node") in errors[0], errors[0]
