#!/usr/bin/env python3
"""Start a multi-node training job on machines without Slurm: one command per node.

    python run_scripts/launch_nodes.py --hosts node1,node2 -- imagenet_ddp.py -a resnet50 /data/imagenet
    python run_scripts/launch_nodes.py --hostfile hosts.txt --style torchrun -- imagenet_ddp.py -a resnet50 /data/imagenet
    python run_scripts/launch_nodes.py --hosts node1,node2 --run -- imagenet_ddp.py -a resnet50 /data/imagenet

Without --run it prints, for each host, the exact command to paste into a shell on that node
(all nodes see the repository at --workdir, e.g. on a shared file system). The first host is
node 0: the others meet it at --port.

  per-node style   python SCRIPT --dist-url tcp://HOST0:PORT --world-size NODES --rank I ...
                   (each node starts one training process per GPU itself)
  torchrun style   torchrun --nnodes NODES --node-rank I --nproc-per-node K --master-addr HOST0
                   --master-port PORT SCRIPT ...

With --run it runs them all through ssh at once (`ssh -tt HOST 'cd WORKDIR && COMMAND'`), prints
every line of their output prefixed with its host, and ends with the first failing node's exit
status after stopping the others (closing an ssh connection hangs up the processes it started:
that is what -tt, a terminal on the node, is for). A node that exits with 75 (stopped by a signal
after saving a checkpoint) is no failure: the others are left to stop on their own.

Standard library only, so it runs on a login node without PyTorch.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

DEFAULT_PORT = 29500  # torchrun's default master port
DEFAULT_SSH = "ssh -tt -o BatchMode=yes"  # a terminal on the node (see the docstring); never ask for a password
STOPPED_FOR_REQUEUE = 75  # the training scripts' exit status after a signal stop with its checkpoint saved
STOP_GRACE_SECONDS = 10.0  # after SIGTERM, how long a node's command gets before SIGKILL
HOST_PATTERN = re.compile(r"[A-Za-z0-9_.:%\[\]][A-Za-z0-9_.:%\[\]-]*")  # names, IPv4, IPv6; never an ssh option


class UsageError(Exception):
    """A mistake in the command line: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors become one line too
        raise UsageError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="launch_nodes.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s (--hosts H0,H1,... | --hostfile FILE) [options] -- SCRIPT [ARGS...]",
        description=__doc__.split("\n\n", 1)[0],
        epilog="Everything after -- is the training script and its arguments, e.g. "
               "-- imagenet_ddp.py -a resnet50 /data/imagenet")
    parser.add_argument("--hosts", metavar="H0,H1,...", help="the nodes, comma-separated; the first is node 0")
    parser.add_argument("--hostfile", metavar="FILE",
                        help="the nodes, one per line (the first word of each line; # starts a comment)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port on node 0 where the nodes meet (default {DEFAULT_PORT})")
    parser.add_argument("--style", choices=("per-node", "torchrun"), default="per-node",
                        help="per-node: the script starts its processes itself (--dist-url/--world-size/--rank); "
                             "torchrun: torchrun starts them (default per-node)")
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="training processes per node (default: one per GPU of the node)")
    parser.add_argument("--workdir", metavar="DIR", default=os.getcwd(),
                        help="directory on every node to run in: the repository (default: this directory)")
    parser.add_argument("--python", metavar="PY",
                        help="Python on the nodes (default python; in the torchrun style, given: "
                             "PY -m torch.distributed.run instead of torchrun)")
    parser.add_argument("--run", action="store_true", help="run the commands through ssh instead of printing them")
    parser.add_argument("--ssh", metavar="COMMAND", default=DEFAULT_SSH,
                        help=f"how to reach a node: COMMAND HOST 'cd WORKDIR && ...' (default: {DEFAULT_SSH})")
    return parser


def read_hosts(hosts: Optional[str], hostfile: Optional[str]) -> List[str]:
    if hosts is not None and hostfile is not None:
        raise UsageError("argument --hostfile: not allowed with --hosts (give the nodes one way)")
    if hostfile is not None:
        try:
            with open(hostfile, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except OSError as error:
            raise UsageError(f"argument --hostfile: cannot read {hostfile} ({error.strerror})") from None
        names = [line.split("#", 1)[0].split()[0] for line in lines if line.split("#", 1)[0].strip()]
        source = f"argument --hostfile: {hostfile}"
        if not names:
            raise UsageError(f"{source} lists no hosts")
    elif hosts is not None:
        names = [name.strip() for name in hosts.split(",")]
        source = "argument --hosts"
        if not any(names):
            raise UsageError("argument --hosts: no hosts given (e.g. --hosts node1,node2)")
        if not all(names):
            raise UsageError(f"argument --hosts: empty host name in {hosts!r}")
    else:
        raise UsageError("no hosts: give --hosts H0,H1,... or --hostfile FILE")
    for name in names:
        if not HOST_PATTERN.fullmatch(name):
            raise UsageError(f"{source}: {name!r} is not a host name or address")
    seen = set()  # not the names before each (quadratic): a file of a million names takes a second, not hours
    for name in names:
        if name in seen:
            raise UsageError(f"{source}: {name} is listed twice (one command per node; --nproc-per-node sets the "
                             f"processes of each)")
        seen.add(name)
    return names


def node_commands(hosts: List[str], script_and_args: List[str], style: str, port: int,
                  nproc_per_node: Optional[int], python: Optional[str]) -> List[List[str]]:
    """The argv each node runs, node 0 first."""
    master, nodes = hosts[0], len(hosts)
    script, args = script_and_args[0], script_and_args[1:]
    if style == "per-node":
        url_host = f"[{master}]" if ":" in master else master  # an IPv6 address needs brackets in a URL
        per_process = ["--nproc-per-node", str(nproc_per_node)] if nproc_per_node is not None else []
        return [[python or "python", script, "--dist-url", f"tcp://{url_host}:{port}", "--world-size", str(nodes),
                 "--rank", str(rank), *per_process, *args] for rank in range(nodes)]
    launcher = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    # torchrun's "gpu": as many processes as the node has GPUs, the per-node style's default.
    per_node = str(nproc_per_node) if nproc_per_node is not None else "gpu"
    return [[*launcher, "--nnodes", str(nodes), "--node-rank", str(rank), "--nproc-per-node", per_node,
             "--master-addr", master, "--master-port", str(port), script, *args] for rank in range(nodes)]


# The flags this launcher sets for each node (the same among the script's arguments would contradict
# it), and what sets them instead.
LAUNCHER_FLAGS = {"--dist-url": "--hosts (node 0) and --port", "--world-size": "--hosts (one node each)",
                  "--rank": "--hosts (their order)", "--nproc-per-node": "--nproc-per-node before --"}


def check_script_args(script_and_args: List[str]) -> None:
    if not script_and_args:
        raise UsageError("no training script after -- (e.g. -- imagenet_ddp.py -a resnet50 /data/imagenet)")
    if script_and_args[0].startswith("-"):
        raise UsageError(f"expected the training script right after --, got {script_and_args[0]!r}")
    for arg in script_and_args[1:]:
        for flag, instead in LAUNCHER_FLAGS.items():
            if arg == flag or arg.startswith(flag + "="):
                raise UsageError(f"{flag} after --: this launcher sets it for each node (use {instead})")


def remote_command(workdir: str, argv: List[str]) -> str:
    return f"cd {shlex.quote(workdir)} && {shlex.join(argv)}"


def print_commands(hosts: List[str], commands: List[str]) -> None:
    for rank, (host, command) in enumerate(zip(hosts, commands)):
        role = ", where the others meet" if rank == 0 else ""
        print(f"# node {rank} of {len(hosts)}: {host}{role}")
        print(command)


class _Stop(Exception):
    """SIGTERM or Ctrl-C reached this launcher."""


def _raise_stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def _copy_output(stream, prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")  # a terminal (ssh -tt) ends lines with \r\n
        with lock:
            sys.stdout.write(f"{prefix}{line}\n")
            sys.stdout.flush()
    stream.close()


def _stop(processes) -> None:
    """SIGTERM each command's whole process group (an ssh client, or what a local stand-in started),
    then SIGKILL what is still alive after STOP_GRACE_SECONDS."""
    live = [process for process in processes if process.poll() is None]
    for process in live:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in live:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _wait_for_nodes(processes):
    """Wait until every node's command has ended, or one has failed. Returns (status, the failed
    node or None, the nodes still running): 0 when all finished, 75 when one stopped for a requeue."""
    status, running = 0, list(range(len(processes)))
    while running:
        time.sleep(0.1)
        for rank in list(running):
            code = processes[rank].poll()
            if code is None:
                continue
            running.remove(rank)
            if code not in (0, STOPPED_FOR_REQUEUE):
                return code, rank, running
            status = status or code
    return status, None, running


def run_commands(hosts: List[str], commands: List[str], ssh: List[str]) -> int:
    """Run every node's command through ssh at once; the exit status of the job."""
    width = max(len(host) for host in hosts)
    lock = threading.Lock()
    processes, readers = [], []
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for host, command in zip(hosts, commands):
            # A process group of its own, so that stopping a node stops all it started here.
            process = subprocess.Popen([*ssh, host, command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            processes.append(process)
            reader = threading.Thread(target=_copy_output, args=(process.stdout, f"{host:<{width}} | ", lock),
                                      daemon=True)
            reader.start()
            readers.append(reader)
        status, failed, running = _wait_for_nodes(processes)
        if failed is not None:
            running = [rank for rank in running if processes[rank].poll() is None]
            how = f"exited with status {status}" if status >= 0 else f"was killed by {_signal_name(-status)}"
            if status == 255:
                how += " (ssh's own status when it cannot connect)"
            stopping = "; stopping the other nodes" if running else ""
            _report(f"node {failed} ({hosts[failed]}) {how}{stopping}", lock)
            _stop([processes[rank] for rank in running])
            status = status if status > 0 else 128 - status  # killed by signal N: 128 + N, as a shell says
        for reader in readers:
            reader.join(timeout=5)
        return status
    except _Stop as stop:
        for sig in previous:  # stopping already: a second Ctrl-C must not cut that short (SIGKILL follows anyway)
            signal.signal(sig, signal.SIG_IGN)
        _report(f"{stop}: stopping every node", lock)
        _stop(processes)
        return 130 if str(stop) == "SIGINT" else 128 + signal.SIGTERM
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _report(message: str, lock: threading.Lock) -> None:
    with lock:
        print(f"launch_nodes.py: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if "--" in argv:
            split = argv.index("--")
            own, script_and_args = argv[:split], argv[split + 1:]
        else:
            own, script_and_args = argv, []
        ns, unknown = build_parser().parse_known_args(own)
        if unknown:
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (the training script and its arguments "
                             f"go after --)")
        hosts = read_hosts(ns.hosts, ns.hostfile)
        if not 0 < ns.port < 65536:
            raise UsageError(f"argument --port: {ns.port} is not a port number (1 to 65535)")
        if ns.nproc_per_node is not None and ns.nproc_per_node < 1:
            raise UsageError(f"argument --nproc-per-node: {ns.nproc_per_node} is not a positive number")
        check_script_args(script_and_args)
        ssh = shlex.split(ns.ssh)
        if ns.run and not ssh:
            raise UsageError("argument --ssh: empty command")
    except UsageError as error:
        print(f"launch_nodes.py: error: {error}", file=sys.stderr)
        return 2
    argvs = node_commands(hosts, script_and_args, ns.style, ns.port, ns.nproc_per_node, ns.python)
    commands = [remote_command(ns.workdir, node_argv) for node_argv in argvs]
    if not ns.run:
        print_commands(hosts, commands)
        return 0
    return run_commands(hosts, commands, ssh)


if __name__ == "__main__":
    sys.exit(main())
