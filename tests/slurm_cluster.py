"""A real Slurm cluster on this machine, for the tests that submit the batch files (issue 26).

munged, slurmctld and one slurmd per node run as children of the test process, from a temporary
directory: their configuration reaches every Slurm program through SLURM_CONF (nothing under
/etc/slurm is written), the munge key is the cluster's own, and every PID is kept. With network
namespaces, each node is a namespace joined to a bridge that holds the controller's address, with
its own host name (a UTS namespace) and a line in /etc/hosts, so that two nodes, and a lost node,
can be tried on one machine; without them the cluster is this machine alone, one node.

stop() ends it all and restores what it changed: jobs cancelled, every process started with the
cluster's SLURM_CONF killed, namespaces, links and /etc/hosts lines removed, exactly those that
start() added. Tests use it through the session fixture in test_slurm.py. The namespaces, the
bridge and the veth pairs are common.tools.netns's, as Validation B's link is.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tests/slurm_cluster.py` puts only tests/ there: `common` is in the repository
    sys.path.insert(0, str(REPO))
from common import ports  # noqa: E402
from common.tools import netns  # noqa: E402
from common.tools.netns import NETNS_DIR  # noqa: E402

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "ip", "nsenter", "unshare")
HOSTS_FILE = Path("/etc/hosts")
TAG_VARIABLE = "IMAGENET_TEST_SLURM_CLUSTER"
# imn<PID of the process that made it><letter>, then br (bridge), v<i> (link), n<i> (namespace).
TAGS = netns.Tags("imn")


def missing_reason(namespaces: bool) -> Optional[str]:
    """Why this machine cannot run the cluster (None when it can)."""
    if os.geteuid() != 0:
        return "a real Slurm cluster needs root (slurmd runs jobs as their user)"
    wanted = PROGRAMS if namespaces else PROGRAMS[:7]
    absent = [name for name in wanted if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge iproute2 util-linux)"
    if namespaces:
        return _namespace_probe_failure()
    return None


def _namespace_probe_failure() -> Optional[str]:
    """Try what a two-node cluster does (a namespace, a bridge, a veth pair into the namespace, a host
    name of its own) and undo it; says what failed (None: all worked). Named as a cluster of ours, so
    that sweep_abandoned removes it should this process die half-way."""
    network = netns.Network(TAGS.new())
    try:
        namespace = network.add_namespace(0)
        network.add_veth(f"{network.tag}v0", "eth0", peer_namespace=namespace, bridge=network.add_bridge())
        netns.run("nsenter", f"--net={NETNS_DIR / namespace}", "unshare", "--uts", "hostname", "nodeA",
                  what="UTS namespaces", timeout=30)
        return None
    except netns.NetworkError as error:
        return error.missing()
    finally:
        network.remove()


@dataclass
class Node:
    name: str
    address: str
    namespace: Optional[str] = None        # None: this machine itself
    process: Optional[subprocess.Popen] = field(default=None, repr=False)


class SlurmCluster:
    """A cluster of `node_count` nodes with `cpus_per_node` CPUs each, its files under `root`.

    One class of about 350 lines, on purpose: start() and stop() mirror each other step for step
    (every process, namespace, link and /etc/hosts line that one makes, the other removes), and the
    job helpers need the same configuration and environment; split, the pairs would drift apart."""

    def __init__(self, root: Path, node_count: int = 2, cpus_per_node: int = 2):
        self.root = Path(root)
        self.node_count = node_count
        self.cpus_per_node = cpus_per_node
        self.conf = self.root / "slurm.conf"
        self.processes: List[subprocess.Popen] = []
        self.nodes: List[Node] = []
        self.hosts_lines: List[str] = []
        # Names of this cluster's links, namespaces and /etc/hosts lines: our PID (so that a later run
        # can tell an abandoned cluster's from a live one's, sweep_abandoned) and a letter per cluster
        # of this process (netns.Tags).
        self.tag = TAGS.new()
        self.network = netns.Network(self.tag)  # the namespaces and links start() makes; stop() removes them

    # --- the environment a client (sbatch, scontrol) or a job needs ---
    @property
    def env(self) -> Dict[str, str]:
        # TAG_VARIABLE marks every process of the cluster, jobs included, for sweep_abandoned.
        return dict(os.environ, SLURM_CONF=str(self.conf), **{TAG_VARIABLE: self.tag})

    def run(self, *argv: str, check: bool = True, env: Optional[dict] = None, timeout: float = 60,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        result = subprocess.run(list(map(str, argv)), env=env or self.env, capture_output=True, text=True,
                                timeout=timeout, cwd=cwd)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, argv))}: status {result.returncode}: {result.stderr.strip()}")
        return result

    # --- start ---
    def start(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for leftover in sweep_abandoned():
            print(f"slurm_cluster: removed {leftover} of an earlier test cluster whose process is gone", file=sys.stderr)
        for folder in ("munge", "state", "spool", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        controller_address = self._make_network()
        self._start_munge()
        self._write_config(controller_address)
        self._spawn(["slurmctld", "-D", "-f", self.conf], "slurmctld")
        for node in self.nodes:
            self.start_node(node)
        self.wait_until_idle(timeout=60)

    def _make_network(self) -> str:
        hostname = socket.gethostname().split(".")[0]
        if self.node_count == 1:
            self.nodes = [Node(hostname, "127.0.0.1")]
            return "127.0.0.1"
        # Another live cluster's /etc/hosts lines would give our node names a second address.
        others = [line for line in HOSTS_FILE.read_text().splitlines() if "test Slurm cluster" in line]
        if others:
            raise RuntimeError(f"another test Slurm cluster is up on this machine ({HOSTS_FILE}: {others[0]!r}): "
                               "stop it first (Ctrl-C where `tests/slurm_cluster.py` runs)")
        subnet = netns.free_subnet("10.213")
        bridge = self.network.add_bridge(f"{subnet}.1")
        for index in range(self.node_count):
            node = Node(f"node{chr(ord('A') + index)}", f"{subnet}.{11 + index}", self.network.add_namespace(index))
            self.nodes.append(node)
            self.network.add_veth(f"{self.tag}v{index}", "eth0", peer_namespace=node.namespace, bridge=bridge)
            netns.configure(node.namespace, "eth0", node.address)
        # The node names must resolve everywhere: srun, torchrun's rendezvous and gloo look them up.
        self._add_hosts_lines([f"{node.address} {node.name}  # {self.tag} test Slurm cluster" for node in self.nodes])
        return f"{subnet}.1"

    def _add_hosts_lines(self, lines: List[str]) -> None:
        text = HOSTS_FILE.read_text()
        self.hosts_lines = lines
        self.hosts_added = ("" if text.endswith("\n") or not text else "\n") + "".join(f"{line}\n" for line in lines)
        # Written in place: in a container /etc/hosts is a mount point, which a rename cannot replace.
        HOSTS_FILE.write_text(text + self.hosts_added)

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._spawn(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                     f"--pid-file={self.root / 'munge' / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                     f"--seed-file={self.root / 'munge' / 'munged.seed'}"], "munged")
        _wait_for(lambda: self.munge_socket.exists(), 20, "munged's socket", self.root / "log" / "munged.log")

    def _write_config(self, controller_address: str) -> None:
        hostname = socket.gethostname().split(".")[0]
        ctld_port, slurmd_port = ports.free_port(), ports.free_port()
        lines = [
            "ClusterName=imagenet-tests",
            f"SlurmctldHost={hostname}({controller_address})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "SlurmUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log'}/slurmd-%n.log",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=10",      # a lost node is noticed within seconds, not the default 5 minutes
            "SlurmctldTimeout=10",
            "MessageTimeout=5",
            "KillWait=20",
            "MinJobAge=3600",        # finished jobs stay visible to scontrol for the whole test run
            "InactiveLimit=0",
            "SchedulerType=sched/builtin",
        ]
        lines += [f"NodeName={node.name} NodeAddr={node.address} CPUs={self.cpus_per_node} State=UNKNOWN"
                  for node in self.nodes]
        lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start_node(self, node: Node) -> None:
        """Start (or start again) the node's slurmd, in its namespaces when it has them."""
        command = ["slurmd", "-D", "-f", str(self.conf), "-N", node.name]
        if node.namespace:
            command = ["nsenter", f"--net={NETNS_DIR / node.namespace}", "unshare", "--uts", "sh", "-c",
                       'hostname "$0" && exec "$@"', node.name, *command]
        node.process = self._spawn(command, f"slurmd-{node.name}-stdout")

    def _spawn(self, command, log_name: str) -> subprocess.Popen:
        log = open(self.root / "log" / f"{log_name}.out", "ab")
        # A new session: Ctrl-C in the terminal reaches pytest, which then stops the cluster in order.
        process = subprocess.Popen(list(map(str, command)), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.processes.append(process)
        return process

    # --- nodes and jobs ---
    def node_states(self) -> Dict[str, str]:
        output = self.run("sinfo", "--noheader", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in output.splitlines() if len(line.split()) == 2)

    def wait_until_idle(self, timeout: float = 60) -> None:
        """Every node up and idle (after a restart: resumed)."""
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                self.start_node(node)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == len(self.nodes) and all(state == "idle" for state in states.values()):
                return
            for name, state in states.items():
                if state.rstrip("*") in ("down", "drained", "draining", "fail"):
                    self.run("scontrol", "update", f"NodeName={name}", "State=RESUME", check=False)
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster's nodes are not idle after {timeout:.0f} s: {self.node_states()}\n"
                           + self.log_tail())

    def lose_node(self, node: Node) -> None:
        """The node fails: its slurmd and every process in its network namespace die at once."""
        assert node.namespace, "only a node in its own namespace can be lost"
        for pid in netns.namespace_pids(node.namespace):
            netns.kill(pid)
        if node.process is not None:
            node.process.wait(timeout=10)

    def submit(self, argv: List[str], env: dict, cwd: Path) -> int:
        """sbatch argv...; returns the job id."""
        result = self.run("sbatch", "--parsable", *argv, env=dict(env, SLURM_CONF=str(self.conf), **{TAG_VARIABLE: self.tag}),
                          cwd=cwd)
        return int(result.stdout.strip().split(";")[0].split("_")[0])

    def job(self, job_id) -> Dict[str, str]:
        """scontrol's fields of a job (JobState, Restarts, ExitCode, Reason, ...); of its first array task."""
        for attempt in range(3):  # a busy controller may miss MessageTimeout once
            result = self.run("scontrol", "-o", "show", "job", str(job_id), check=attempt == 2)
            if result.returncode == 0:
                return dict(re.findall(r"(\w+)=(\S*)", result.stdout.splitlines()[0]))
            time.sleep(1)

    def wait_for_job(self, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
                     timeout: float = 300, poll_seconds: float = 0.5) -> Dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('JobState')} after {timeout:.0f} s "
                                   f"(waiting for {'/'.join(states)}): {job}\n{self.log_tail()}")
            time.sleep(poll_seconds)

    def log_tail(self, lines: int = 15) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- stop ---
    def stop(self) -> List[str]:
        """End the cluster and undo what start() did; returns what could not be undone (empty: all).
        Each step runs whatever the one before it did, and Ctrl-C or SIGTERM wait until the end: a
        half-done stop would leave daemons, namespaces or a half-written /etc/hosts behind."""
        problems: List[str] = []
        steps = (self._cancel_jobs, self._end_daemons, self._kill_leftover_processes, self._remove_network,
                 self._remove_hosts_lines)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for step in steps:
                try:
                    problems += step()
                except Exception as error:  # noqa: BLE001 -- the next steps must run all the same
                    problems.append(f"{step.__name__.strip('_').replace('_', ' ')}: {error!r}")
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return problems + self.traces()

    def _cancel_jobs(self) -> List[str]:
        if self.conf.exists() and any(process.poll() is None for process in self.processes):
            self.run("scancel", "--full", "--user=root", check=False, timeout=20)
        return []

    def _end_daemons(self) -> List[str]:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        return []

    def _kill_leftover_processes(self) -> List[str]:
        # Job steps (slurmstepd) and the jobs' processes left behind: all carry our SLURM_CONF.
        for _ in range(3):
            leftovers = self.leftover_pids()
            for pid in leftovers:
                netns.kill(pid)
            if not leftovers:
                break
            time.sleep(0.5)
        return []

    def _remove_network(self) -> List[str]:
        return self.network.remove()

    def _remove_hosts_lines(self) -> List[str]:
        if self.hosts_lines:
            text = HOSTS_FILE.read_text()
            if self.hosts_added in text:     # the file as it was found, byte for byte
                text = text.replace(self.hosts_added, "", 1)
            else:                            # edited since: take out our lines, keep the rest
                text = "".join(line for line in text.splitlines(keepends=True)
                               if line.rstrip("\n") not in self.hosts_lines)
            HOSTS_FILE.write_text(text)
            self.hosts_lines = []
        return []

    def traces(self) -> List[str]:
        """What of the cluster is still on the machine: processes, namespaces, links, /etc/hosts lines."""
        found = [f"process {pid} still running" for pid in self.leftover_pids()] + self.network.traces()
        hosts = HOSTS_FILE.read_text() if HOSTS_FILE.exists() else ""
        found += [f"/etc/hosts: {line}" for line in hosts.splitlines() if self.tag in line]
        return found

    def leftover_pids(self) -> List[int]:
        """Processes started with this cluster's SLURM_CONF in their environment (ours excluded)."""
        return [pid for pid, conf in _environment_values("SLURM_CONF").items() if conf == str(self.conf)]


def sweep_abandoned() -> List[str]:
    """Remove what test clusters of processes that no longer exist left behind (a test run killed
    with SIGKILL, or by a power cut, cannot stop its cluster): their processes, namespaces, links and
    /etc/hosts lines. A live process's cluster is never touched. Returns what was removed."""
    removed = []
    for pid, tag in _environment_values(TAG_VARIABLE).items():
        if TAGS.abandoned(tag):
            netns.kill(pid)
            removed.append(f"process {pid}")
    removed += netns.sweep_abandoned(TAGS)
    if HOSTS_FILE.exists():
        lines = HOSTS_FILE.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not ("test Slurm cluster" in line and TAGS.abandoned(line))]
        if len(kept) != len(lines):
            HOSTS_FILE.write_text("".join(kept))
            removed += [f"/etc/hosts line {line.strip()!r}" for line in lines if line not in kept]
    return removed


def _environment_values(name: str) -> Dict[int, str]:
    """PID -> the value of environment variable `name`, for every process that has it (ours excluded)."""
    prefix, found = f"{name}=".encode(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            variables = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for variable in variables:
            if variable.startswith(prefix):
                found[int(entry.name)] = variable[len(prefix):].decode(errors="replace")
    return found


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


class SigtermInterrupts:
    """While the cluster is up, SIGTERM (a CI time-out, `kill`) interrupts like Ctrl-C, so that pytest
    tears the cluster's fixture down, and main() its cluster, instead of dying with it running."""

    def __enter__(self):
        self.previous = signal.signal(signal.SIGTERM, _interrupt)
        return self

    def __exit__(self, *exc_info):
        signal.signal(signal.SIGTERM, self.previous)


def _wait_for(condition, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace") if log.exists() else "(no log)"
            raise RuntimeError(f"{what} did not appear within {timeout:.0f} s: {text[-2000:]}")
        time.sleep(0.1)


def build_parser():
    import argparse

    def node_count(text: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= 26:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of nodes from 1 to 26")
        return int(text)

    parser = argparse.ArgumentParser(
        prog="tests/slurm_cluster.py",
        description="A real Slurm cluster on this machine (root; Debian's slurm-wlm and munge), the one the tests "
                    "submit the batch files to, kept up until Ctrl-C to try them on (docs/launching.md).")
    parser.add_argument("folder", type=Path, help="its configuration, state and logs go here (made if missing)")
    parser.add_argument("--nodes", type=node_count, default=1, metavar="N",
                        help="1: this machine itself; 2 or more: one network namespace per node (default 1)")
    return parser


def main(argv=None) -> int:
    """`sudo python tests/slurm_cluster.py [--nodes N] DIR`: the tests' cluster, kept up until Ctrl-C,
    to try the batch files on before a real cluster (docs/launching.md)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    reason = missing_reason(namespaces=args.nodes > 1)
    if reason:
        parser.exit(2, f"{parser.prog}: error: {reason}\n")
    cpus = max(1, (os.cpu_count() or 1) // args.nodes) if args.nodes > 1 else os.cpu_count() or 1
    cluster = SlurmCluster(args.folder.resolve(), node_count=args.nodes, cpus_per_node=cpus)
    try:
        with SigtermInterrupts():
            return _serve_until_interrupted(cluster, cpus)
    except KeyboardInterrupt:
        return 0
    finally:
        problems = cluster.stop()
        print("stopped" + (f"; not undone: {problems}" if problems else ", nothing left behind"), flush=True)


def _serve_until_interrupted(cluster: SlurmCluster, cpus: int) -> int:
    cluster.start()
    print(f"Slurm is up: {', '.join(node.name for node in cluster.nodes)} ({cpus} CPUs each). In another shell:\n"
          f"  export SLURM_CONF={cluster.conf}\n  sinfo\n"
          f"Logs in {cluster.root / 'log'}. Ctrl-C stops it and removes what it set up.", flush=True)
    while all(process.poll() is None for process in cluster.processes):
        time.sleep(1)
    print("a Slurm daemon ended: stopping (see the logs)", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
