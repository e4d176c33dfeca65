"""Network namespaces, bridges and veth pairs: several "nodes" on one machine.

Two users: Validation B of the scaling model (common.tools.link_validation:
two namespaces joined by a veth pair, tbf on each end) and the tests' real
Slurm cluster (tests/slurm_cluster.py: one namespace per node behind a bridge).
Both need root and iproute2.

- Names. Everything made is named after a tag (Tags.new): the user's prefix,
  the PID of the process that made it and a letter, then a suffix (n0, br,
  v1, ...), 15 characters at most, Linux's limit for a link name. A process
  killed outright (SIGKILL, a power cut) cannot remove what it made; the next
  one does (sweep_abandoned): what is named after a PID that no longer exists
  is abandoned, a live process's is never touched.
- Undoing. A Network records what it made and removes it again (remove()):
  namespaces first, the processes still in them killed (a veth pair goes with
  either of its namespaces), then the links left on this machine, then
  /run/netns when its own first namespace made it: `ip netns add` creates that
  folder and bind-mounts it on itself, and it is left as it was found.
- Failures. A command that fails raises NetworkError, whose message is the
  command, its exit status and its stderr; `what` says which capability the
  command needed (network namespaces, veth pairs, ...), for a probe's "no ...
  here" when the machine lacks it. What remove() cannot undo it returns, in
  the same words.
"""
from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence

NETNS_DIR = Path("/run/netns")  # where `ip netns add` names namespaces: made, and bind-mounted, by the first one


class NetworkError(RuntimeError):
    """Making or changing the network failed: the message says what was done (a command, its exit status and
    its stderr); `what`, the capability it needed ('' when none), for a probe's wording (missing())."""

    def __init__(self, message: str, what: str = ""):
        super().__init__(message)
        self.what = what

    def missing(self) -> str:
        """What this machine cannot do, and why: a probe's answer."""
        return f"no {self.what} here ({self})" if self.what else str(self)


def run(*argv, check: bool = True, what: str = "", timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a command, its output captured as text; with `check`, a non-zero
    status raises NetworkError (`what`: the capability the command needed)."""
    argv = list(map(str, argv))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise NetworkError(_failure(argv, result), what)
    return result


def _failure(argv: Sequence, result: subprocess.CompletedProcess) -> str:
    words = (result.stderr or "").strip() or (result.stdout or "").strip()
    return f"{' '.join(map(str, argv))}: status {result.returncode}: {words}"


class Tags:
    """Tags for the names of what one user makes: `<prefix><PID><letter>`, a
    letter per tag this process asks for (after z, a again: by then the first
    is long removed). Finds them again in namespace and link names, in
    environment variables and in lines of text."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._count = itertools.count()
        # The tag, then the suffix of a name made from it (n0, br, v12, a), up to the end of the word.
        self._pattern = re.compile(rf"\b({re.escape(prefix)}(\d+)[a-z])[a-z]*\d*\b")

    def new(self) -> str:
        return f"{self.prefix}{os.getpid()}{chr(ord('a') + next(self._count) % 26)}"

    def abandoned(self, text: str) -> Optional[str]:
        """The first tag of ours in `text` when the process it names is gone (None: no tag, or its owner lives)."""
        match = self._pattern.search(text)
        return match.group(1) if match and not Path(f"/proc/{match.group(2)}").exists() else None

    def is_name(self, name: str) -> bool:
        """Whether `name` is one this user gives (a tag and its suffix, nothing else)."""
        return self._pattern.fullmatch(name) is not None


def kill(pid: int, signum: int = signal.SIGKILL) -> None:
    """Signal `pid`, which may have ended meanwhile."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def namespace_pids(name: str) -> List[int]:
    """The processes in network namespace `name`."""
    return [int(pid) for pid in run("ip", "netns", "pids", name, check=False).stdout.split()]


def namespaces() -> List[str]:
    """The named network namespaces (`ip netns list`, without its ids)."""
    return [line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line.split()]


def links() -> List[str]:
    """The network links of this namespace (`ip -o link`; a veth end's '@peer' dropped)."""
    lines = run("ip", "-o", "link", check=False).stdout.splitlines()
    return [line.split(":")[1].strip().split("@")[0] for line in lines if line.count(":") >= 2]


def delete_namespace(name: str) -> List[str]:
    """Kill what runs in network namespace `name`, then delete it; returns what could not be done."""
    for pid in namespace_pids(name):
        kill(pid)
    result = run("ip", "netns", "delete", name, check=False)
    if result.returncode != 0 and (NETNS_DIR / name).exists():
        return [f"namespace {name}: {_failure(result.args, result)}"]
    return []


def delete_link(name: str) -> List[str]:
    """Delete link `name` of this namespace; returns what could not be done (a link already gone is done)."""
    result = run("ip", "link", "delete", name, check=False)
    if result.returncode != 0 and run("ip", "link", "show", name, check=False).returncode == 0:
        return [f"link {name}: {_failure(result.args, result)}"]
    return []


def remove_empty_netns_dir() -> List[str]:
    """/run/netns as it was before our first namespace: absent (while no other namespace is in it).
    Returns what could not be undone."""
    if not NETNS_DIR.exists() or any(NETNS_DIR.iterdir()):
        return []
    while is_mount_point(NETNS_DIR):  # iproute2 bind-mounts it on itself, same device: os.path.ismount misses it
        result = run("umount", NETNS_DIR, check=False)
        if result.returncode != 0:
            return [f"{NETNS_DIR}: could not be unmounted ({_failure(result.args, result)})"]
    try:
        NETNS_DIR.rmdir()
    except OSError as error:
        return [f"{NETNS_DIR}: {error.strerror}"]
    return []


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted on `path`, by /proc/self/mountinfo (which sees bind mounts too)."""
    with open("/proc/self/mountinfo") as mounts:
        return any(_unescape_mount_path(line.split()[4]) == str(path) for line in mounts)


def _unescape_mount_path(field: str) -> str:
    # The kernel writes a space, tab, newline and backslash of a mount point as octal escapes: \040 \011 \012 \134.
    return re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), field)


def free_subnet(prefix: str) -> str:
    """A /24 under `prefix` (two octets, '10.213') that no address or route of this machine uses:
    '10.213.x', from a third octet drawn from our PID, so that two processes rarely try the same."""
    used = run("ip", "-4", "-o", "addr", check=False).stdout + run("ip", "-4", "route", check=False).stdout
    for third in range(os.getpid() % 200, os.getpid() % 200 + 50):
        subnet = f"{prefix}.{third % 250}"
        if f" {subnet}." not in used:
            return subnet
    raise NetworkError(f"no free {prefix}.x.0/24 subnet (ip -4 addr, ip -4 route)", what="free subnets")


def configure(namespace: str, interface: str, address: str) -> None:
    """In `namespace`: `address`/24 on `interface`, it up, and loopback up."""
    run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface, what="addresses")
    run("ip", "-n", namespace, "link", "set", interface, "up", what="links up")
    run("ip", "-n", namespace, "link", "set", "lo", "up", what="loopback")


class Network:
    """The namespaces and links that one user made under one tag, and remove(), which undoes them."""

    def __init__(self, tag: str):
        self.tag = tag
        self.namespaces: List[str] = []
        self.links: List[str] = []        # on this machine (a bridge, a veth pair's end left here)
        self.made_netns_dir = False       # whether our first namespace made /run/netns (remove() removes it then)

    def add_namespace(self, index: int) -> str:
        """Network namespace `<tag>n<index>`; returns its name."""
        name = f"{self.tag}n{index}"
        if not self.namespaces:
            self.made_netns_dir = not NETNS_DIR.exists()
        run("ip", "netns", "add", name, what="network namespaces")
        self.namespaces.append(name)
        return name

    def add_bridge(self, address: Optional[str] = None) -> str:
        """Bridge `<tag>br` on this machine, up with `address`/24 when given; returns its name."""
        name = f"{self.tag}br"
        run("ip", "link", "add", name, "type", "bridge", what="bridges")
        self.links.append(name)
        if address:
            run("ip", "addr", "add", f"{address}/24", "dev", name, what="addresses")
            run("ip", "link", "set", name, "up", what="links up")
        return name

    def add_veth(self, end: str, peer: str, end_namespace: Optional[str] = None,
                 peer_namespace: Optional[str] = None, bridge: Optional[str] = None) -> None:
        """A veth pair `end`-`peer`, each end in its namespace (None: this machine); an end left on this
        machine joins `bridge`, when given, and is up."""
        where = lambda namespace: ["netns", namespace] if namespace else []  # noqa: E731
        run("ip", "link", "add", end, *where(end_namespace), "type", "veth", "peer", "name", peer,
            *where(peer_namespace), what="veth pairs")
        if end_namespace is None:
            self.links.append(end)
            if bridge:
                run("ip", "link", "set", end, "master", bridge, what="bridges")
                run("ip", "link", "set", end, "up", what="links up")

    def remove(self) -> List[str]:
        """Delete the namespaces (and what runs in them), then the links; /run/netns when our first namespace
        made it and every namespace went. Returns what could not be done (empty: all)."""
        problems: List[str] = []
        for namespace in self.namespaces:
            problems += delete_namespace(namespace)
        if self.made_netns_dir and not problems:
            problems += remove_empty_netns_dir()
        for link in reversed(self.links):  # veth ends went with their namespace; a bridge last
            problems += delete_link(link)
        return problems

    def traces(self) -> List[str]:
        """What of this tag is still on the machine: namespaces and links."""
        return [f"namespace {name}" for name in namespaces() if self.tag in name] + \
               [f"link {name}" for name in links() if self.tag in name]


def sweep_abandoned(tags: Tags) -> List[str]:
    """Delete the namespaces and links named after `tags` whose process no longer exists (killed before it
    could remove them); a live process's are never touched. Returns what was removed."""
    removed = []
    for name in namespaces():
        if tags.is_name(name) and tags.abandoned(name):
            delete_namespace(name)
            removed.append(f"namespace {name}")
    for name in links():
        if tags.is_name(name) and tags.abandoned(name):
            delete_link(name)
            removed.append(f"link {name}")
    return removed
