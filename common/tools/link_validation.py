"""Validation B of the scaling model (common.tools.scaling): a real DDP
training run over a link of known bandwidth, measured and predicted.

    python -m common.tools.link_validation --rates 200mbit 1gbit --out results/scaling/validation-b.csv   # root

Two network namespaces joined by a veth pair stand in for two nodes; `tc
qdisc ... tbf rate R` on each end limits each direction of the link to R
(this kernel has no netem: no latency is added). imagenet_ddp.py runs one
process in each namespace (gloo, CPU, --synthetic, one thread each) with each
--ddp-comm-hook of --hooks, and its measured seconds per step (metrics.csv,
after --throughput-warmup-steps) is compared with the model's prediction from
  - compute: the same run without gradient communication: imagenet_ddp.py
    with a world of one, two of them at once, each with one thread (as the two
    training processes share this machine's cores), its step time;
  - the link: the TCP payload rate measured between the namespaces (one
    direction; a ring all-reduce of two processes sends both ways at once, and
    tbf limits each direction apart), and the TCP round trip / 2 as the
    latency of a ring step;
  - DDP's buckets and the overlap of their all-reduces with backward, as the
    model computes them for every GPU count.
The payload rate is below the tbf rate by the headers: tbf counts whole
Ethernet frames, 1,514 bytes for 1,448 of TCP payload at MTU 1500 (TCP
timestamps on), 95.6%.

Needs root, iproute2 (ip netns, veth) and tc with the tbf qdisc; missing_reason()
says what is missing. Everything made is named imlv<pid><letter>... and removed
at the end, and what an earlier process killed before its clean-up left is
removed first: the namespaces and the veth pair are common.tools.netns's, as
the tests' Slurm cluster's are.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from common.arguments import Parser, positive_float, positive_int
from common.errors import UsageError, run_main
from common.files import atomic_write_text
from common.ports import free_port
from common.tools import netns, scaling

REPO = Path(__file__).resolve().parents[2]
# imlv<PID of the process that made it><letter>, then n0 and n1 (the namespaces), a and b (the veth pair's ends).
TAGS = netns.Tags("imlv")
# TCP payload over the Ethernet frame tbf counts, at MTU 1500: 1500 - 20 (IP) - 20 (TCP) - 12 (timestamps)
# = 1448 bytes in 1514 (the 14-byte Ethernet header; tbf sees the frame without preamble or CRC).
TCP_PAYLOAD_FRACTION = 1448 / 1514
# All-reduce sizes measured over the link: the smallest for the latency, DDP's 25 MiB bucket for the bandwidth.
ALLREDUCE_SIZES = (4096, 25 << 20)
CSV_COLUMNS = ["link", "tbf_rate_mbit", "tcp_payload_mbit", "round_trip_us", "allreduce_busbw_mbit",
               "allreduce_latency_us", "hook", "arch", "batch_size",
               "image_size", "warmup_steps", "measured_steps", "compute_ms", "measured_ms", "predicted_ms",
               "predicted_comm_ms", "predicted_exposed_comm_ms", "comm_mib_per_step", "difference_percent",
               "tolerance_percent", "within_tolerance"]


def parse_rate(text: str) -> float:
    """'200mbit', '1gbit', '500kbit' (tc's units, powers of 1000) -> bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a rate like 200mbit or 1gbit, got {text!r}")
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def missing_reason() -> Optional[str]:
    """Why this machine cannot run the validation (None when it can): tries a
    namespace pair, a veth pair between them and tbf on it, and undoes them."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    absent = [name for name in ("ip", "tc") if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install iproute2)"
    try:
        with VethPair(200e6):
            pass
    except netns.NetworkError as error:
        return error.missing()
    return None


class LinkError(RuntimeError):
    """A measurement or a training run over the link failed: which, and its own words."""


class VethPair:
    """Two network namespaces, n0 and n1, joined by a veth pair (addresses
    .1 and .2 of a free 10.214.x.0/24), each end's egress limited by tbf.
    A context manager: whatever was made is removed on leaving, even half-way."""

    def __init__(self, rate_bits_per_second: float, burst: str = "64kb", latency: str = "50ms"):
        self.network = netns.Network(TAGS.new())
        self.tag = self.network.tag
        self.namespaces = (f"{self.tag}n0", f"{self.tag}n1")
        self.interfaces = (f"{self.tag}a", f"{self.tag}b")
        self.rate, self.burst, self.latency = rate_bits_per_second, burst, latency
        self.addresses = ("", "")

    def __enter__(self) -> "VethPair":
        netns.sweep_abandoned(TAGS)
        try:
            subnet = netns.free_subnet("10.214")
            self.addresses = (f"{subnet}.1", f"{subnet}.2")
            for index in range(len(self.namespaces)):
                self.network.add_namespace(index)
            self.network.add_veth(*self.interfaces, *self.namespaces)
            for namespace, interface, address in zip(self.namespaces, self.interfaces, self.addresses):
                netns.configure(namespace, interface, address)
            self.set_rate(self.rate)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def set_rate(self, rate_bits_per_second: float) -> None:
        """tbf on both ends at this rate (each direction of the link apart)."""
        self.rate = rate_bits_per_second
        for namespace, interface in zip(self.namespaces, self.interfaces):
            netns.run("tc", "-n", namespace, "qdisc", "replace", "dev", interface, "root", "tbf",
                      "rate", f"{rate_bits_per_second / 1e3:.0f}kbit", "burst", self.burst, "latency", self.latency,
                      what="the tbf qdisc (tc)")

    def command(self, index: int, argv: Sequence[str], environment: Dict[str, str]) -> List[str]:
        """argv run in namespace `index`, with these variables set (env(1))."""
        return ["ip", "netns", "exec", self.namespaces[index], "env",
                *(f"{name}={value}" for name, value in environment.items()), *argv]

    def remove(self) -> List[str]:
        """Delete both namespaces (the veth pair goes with them, and any
        process left in them is killed first); returns what could not be done."""
        return self.network.remove()


# --- the link, measured ----------------------------------------------------------------------------------

# A one-way TCP transfer (payload bytes over the time from the first byte to the last) and a round trip
# of one byte, each a small Python program run in a namespace.
_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
connection, _ = server.accept()
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):  # round trips first
    connection.sendall(connection.recv(1))
expected, received, started = int(sys.argv[4]), 0, None
while received < expected:
    data = connection.recv(1 << 20)
    if not data:
        break
    started = started or time.perf_counter()
    received += len(data)
print(received, time.perf_counter() - started, flush=True)
connection.sendall(b"k")
"""
_SENDER = """
import socket, statistics, sys, time
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
trips = []
for _ in range(int(sys.argv[3])):
    started = time.perf_counter()
    connection.sendall(b"x")
    connection.recv(1)
    trips.append(time.perf_counter() - started)
chunk, remaining = bytes(1 << 20), int(sys.argv[4])
while remaining > 0:
    connection.sendall(chunk[:remaining])
    remaining -= len(chunk)
connection.recv(1)
print(statistics.median(trips), flush=True)
"""


@dataclass(frozen=True)
class LinkMeasurement:
    payload_bytes_per_second: float  # TCP payload, one direction
    round_trip_seconds: float  # median of one-byte round trips


def measure_link(pair: VethPair, transfer_bytes: Optional[int] = None, round_trips: int = 50) -> LinkMeasurement:
    """TCP from namespace 0 to 1: the payload rate of a transfer of about
    half a second at the tbf rate (at least 4 MB, so tbf's burst is a small
    part of it) and the median round trip of one byte."""
    transfer_bytes = transfer_bytes or max(4 << 20, int(pair.rate / 8 * 0.5))
    port = free_port()
    receiver = subprocess.Popen(pair.command(1, [sys.executable, "-c", _RECEIVER, pair.addresses[1], str(port),
                                                 str(round_trips), str(transfer_bytes)], {}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "listening":
            raise LinkError(f"the TCP receiver did not start: {receiver.stderr.read()[-500:]}")
        sent = netns.run(*pair.command(0, [sys.executable, "-c", _SENDER, pair.addresses[1], str(port),
                                           str(round_trips), str(transfer_bytes)], {}), check=False, timeout=120)
        if sent.returncode != 0:
            raise LinkError(f"the TCP sender failed: {sent.stderr.strip()[-500:]}")
        received, seconds = receiver.stdout.readline().split()
        receiver.wait(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return LinkMeasurement(int(received) / float(seconds), float(sent.stdout.strip()))


# --- the training runs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """What every training run of the validation trains: a model whose gradients
    (ResNet-18: 11.7 M, 44.6 MiB in fp32) take seconds at 200 Mbit/s, at an
    image size where its compute on one core is of the same order at 1 Gbit/s."""

    arch: str = "resnet18"
    batch_size: int = 16
    image_size: int = 64
    warmup_steps: int = 2
    measured_steps: int = 3

    def flags(self, logdir: Path, run_name: str) -> List[str]:
        return ["imagenet_ddp.py", "--synthetic", "-a", self.arch, "-b", str(self.batch_size),
                "--image-size", str(self.image_size), "--val-resize", str(self.image_size), "-j", "0",
                "--device", "cpu", "--epochs", "1", "--steps-per-epoch", str(self.warmup_steps + self.measured_steps),
                "--throughput-warmup-steps", str(self.warmup_steps), "--checkpoint-every", "0",
                "--io-interval", "0", "-p", "1000000", "--logdir", str(logdir), "--run-name", run_name]


# One compute thread per training process: two processes share the machine's (2) cores, as two nodes' would
# not, so that the compute measured alone is the compute of the linked run. Set for the child, not read here.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _step_ms(run_dir: Path) -> float:
    """Seconds per measured step (after the throughput warm-up) of a run's training row, in ms."""
    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["split"] == "train"]
    return 1000.0 * float(rows[-1]["seconds_per_step"])


def _bucket_cap_mb(run_dir: Path) -> Optional[float]:
    options = json.loads((run_dir / "config.json").read_text()).get("options", {})
    value = options.get("bucket_cap_mb")
    return None if value is None else float(value)


def _wait_all(processes: Sequence[subprocess.Popen], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        outputs = [process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
            process.wait()
        raise LinkError(f"{what}: still running after {timeout:.0f} s") from None
    for process, output in zip(processes, outputs):
        if process.returncode != 0:
            last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
            raise LinkError(f"{what} failed (exit {process.returncode}): {last[-300:]}")


def compute_step_ms(workload: Workload, logdir: Path, timeout: float = 300) -> Dict[str, float]:
    """The step without communication: two one-process imagenet_ddp.py runs
    at once on this machine, one thread each; their step times (ms) and bucket cap."""
    processes = [subprocess.Popen([sys.executable, *workload.flags(logdir, f"alone-{index}"), "--nproc-per-node", "1"],
                                  cwd=REPO, env={**os.environ, **ONE_THREAD}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for index in range(2)]
    _wait_all(processes, "the runs without communication", timeout)
    times = [_step_ms(logdir / f"alone-{index}") for index in range(2)]
    return {"compute_ms": statistics.mean(times), "spread_ms": max(times) - min(times),
            "bucket_cap_mb": _bucket_cap_mb(logdir / "alone-0")}


def linked_step_ms(pair: VethPair, workload: Workload, hook: str, logdir: Path, run_name: str,
                   timeout: float = 300) -> float:
    """imagenet_ddp.py with one process in each namespace over the link; its ms per measured step."""
    url = f"tcp://{pair.addresses[0]}:{free_port()}"
    processes = []
    for rank in range(2):
        # gloo picks its interface from the host name, which resolves outside the namespaces: name it.
        environment = {**ONE_THREAD, "GLOO_SOCKET_IFNAME": pair.interfaces[rank]}
        argv = [sys.executable, *workload.flags(logdir, run_name), "--dist-url", url, "--world-size", "2",
                "--rank", str(rank), "--nproc-per-node", "1", "--ddp-comm-hook", hook]
        processes.append(subprocess.Popen(pair.command(rank, argv, environment), cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    _wait_all(processes, f"imagenet_ddp.py over the link (--ddp-comm-hook {hook})", timeout)
    return _step_ms(logdir / run_name)


# --- prediction ------------------------------------------------------------------------------------------------

def measure_allreduce(pair: VethPair, sizes: Sequence[int] = ALLREDUCE_SIZES, timeout: float = 120) -> List[dict]:
    """gloo's all-reduce between the namespaces (common.tools.bench.comm_bench,
    one process in each, one thread): rows as the benchmark's comm section writes
    them (section comm, size_bytes, time_us, busbw_gbytes_per_s, world_size, nodes)."""
    url = f"tcp://{pair.addresses[0]}:{free_port()}"
    processes = []
    for rank in range(2):
        argv = [sys.executable, "-m", "common.tools.bench.comm_bench", "--init", url, "--rank", str(rank),
                "--world-size", "2", "--sizes", *map(str, sizes), "--iterations", "5", "--budget-seconds", "3"]
        environment = {**ONE_THREAD, "GLOO_SOCKET_IFNAME": pair.interfaces[rank]}
        processes.append(subprocess.Popen(pair.command(rank, argv, environment), cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    if any(process.returncode for process in processes):
        raise LinkError(f"the all-reduce measurement failed: {outputs[0][-300:]} {outputs[1][-300:]}")
    return [dict(json.loads(line), section="comm", backend="gloo", world_size=2, nodes=2)
            for line in outputs[0].splitlines() if line.startswith("{")]


def links_from_allreduce(rows: Sequence[dict], folder: Path) -> scaling.Links:
    """The model's link from the all-reduce rows, read as any comm CSV is
    (scaling.links_from_comm_csv: busbw of the largest size, the smallest
    size's time / 2(n-1) as a ring step's latency); one process per node."""
    path = folder / "comm.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return scaling.links_from_comm_csv(path, replace(scaling.Settings().links, gpus_per_node=1))


def predict_linked(profile: scaling.ModelProfile, workload: Workload, hook: str, compute_ms: float,
                   links: scaling.Links, bucket_cap_mb: Optional[float]) -> scaling.StepPrediction:
    """The model's step at 2 processes, one per node, over `links`; compute is
    the step without communication, all of it forward and backward (the
    optimizer's update inside, as the model takes it by default)."""
    settings = scaling.Settings(arch=workload.arch, image_size=workload.image_size, batch_size=workload.batch_size,
                                step_ms=compute_ms, measured_gpus=1, gpus=(2,), hooks=(hook,),
                                bucket_cap_mb=bucket_cap_mb, links=links)
    buckets = scaling.assign_buckets(profile.gradients, *scaling.ddp_bucket_caps(bucket_cap_mb))
    return scaling.predict_step(settings, profile, buckets, hook, 2, compute_ms)


def validate(rates: Sequence[float], hooks: Sequence[str], workload: Workload = Workload(),
             tolerance_percent: float = 15.0, progress=print) -> List[dict]:
    """Every (rate, hook) case: measured and predicted ms per step, one row each."""
    profile = scaling.profile_model(workload.arch, workload.image_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="link-validation-") as folder:
        logdir = Path(folder)
        alone = compute_step_ms(workload, logdir)
        progress(f"without communication (2 processes at once, 1 thread each): {alone['compute_ms']:.1f} ms/step "
                 f"(the two differ by {alone['spread_ms']:.1f} ms)")
        with VethPair(rates[0]) as pair:
            for rate in rates:
                pair.set_rate(rate)
                link = measure_link(pair)
                allreduce = measure_allreduce(pair)
                links = links_from_allreduce(allreduce, logdir)
                busbw = links.inter_node_bytes_per_second
                progress(f"link {_rate_name(rate)}: TCP payload {link.payload_bytes_per_second * 8 / 1e6:.1f} Mbit/s "
                         f"({100 * link.payload_bytes_per_second * 8 / rate:.1f}% of tbf's rate; frames: "
                         f"{100 * TCP_PAYLOAD_FRACTION:.1f}%), round trip {link.round_trip_seconds * 1e6:.0f} us; "
                         f"gloo all-reduce busbw {busbw * 8 / 1e6:.1f} Mbit/s "
                         f"({100 * busbw / link.payload_bytes_per_second:.0f}% of TCP's), "
                         f"{allreduce[0]['time_us']:.0f} us at {allreduce[0]['size_bytes']} bytes")
                for hook in hooks:
                    measured = linked_step_ms(pair, workload, hook, logdir, f"{_rate_name(rate)}-{hook}")
                    predicted = predict_linked(profile, workload, hook, alone["compute_ms"], links,
                                               alone["bucket_cap_mb"])
                    difference = 100.0 * (measured - predicted.step_ms) / predicted.step_ms
                    rows.append({"link": _rate_name(rate), "tbf_rate_mbit": rate / 1e6,
                                 "tcp_payload_mbit": link.payload_bytes_per_second * 8 / 1e6,
                                 "round_trip_us": link.round_trip_seconds * 1e6,
                                 "allreduce_busbw_mbit": busbw * 8 / 1e6,
                                 "allreduce_latency_us": links.inter_node_latency_seconds * 1e6, "hook": hook, "arch": workload.arch,
                                 "batch_size": workload.batch_size, "image_size": workload.image_size,
                                 "warmup_steps": workload.warmup_steps, "measured_steps": workload.measured_steps,
                                 "compute_ms": alone["compute_ms"], "measured_ms": measured,
                                 "predicted_ms": predicted.step_ms, "predicted_comm_ms": predicted.comm_ms,
                                 "predicted_exposed_comm_ms": predicted.exposed_comm_ms,
                                 "comm_mib_per_step": predicted.comm_bytes / scaling.MIB,
                                 "difference_percent": difference, "tolerance_percent": tolerance_percent,
                                 "within_tolerance": abs(difference) <= tolerance_percent})
                    progress(table_lines(rows[-1:], header=False)[0])
    return rows


def _rate_name(rate: float) -> str:
    return f"{rate / 1e9:g}gbit" if rate >= 1e9 else f"{rate / 1e6:g}mbit"


def table_lines(rows: Sequence[dict], header: bool = True) -> List[str]:
    lines = [f"{'link':>8} {'hook':>5} {'measured_ms':>11} {'predicted_ms':>12} {'difference_%':>12} "
             f"{'exposed_comm_ms':>15} {'compute_ms':>10}"] if header else []
    lines += [f"{row['link']:>8} {row['hook']:>5} {row['measured_ms']:11.1f} {row['predicted_ms']:12.1f} "
              f"{row['difference_percent']:+12.1f} {row['predicted_exposed_comm_ms']:15.1f} {row['compute_ms']:10.1f}"
              for row in rows]
    return lines


def write_csv(rows: Sequence[dict], path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise UsageError(f"argument --out: {path}: exists; nothing written (choose another --out, or --overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(handle) -> None:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: f"{value:.4g}" if isinstance(value, float) else value for key, value in row.items()})

    atomic_write_text(path, write)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m common.tools.link_validation", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--rates", type=parse_rate, nargs="+", default=[200e6, 1e9], metavar="RATE",
                        help="tbf rates of the link, as tc writes them (default: 200mbit 1gbit)")
    parser.add_argument("--hooks", nargs="+", choices=scaling.HOOKS, default=["none", "fp16"])
    parser.add_argument("-a", "--arch", default=Workload.arch)
    parser.add_argument("-b", "--batch-size", type=positive_int, default=Workload.batch_size)
    parser.add_argument("--image-size", type=positive_int, default=Workload.image_size)
    parser.add_argument("--warmup-steps", type=positive_int, default=Workload.warmup_steps)
    parser.add_argument("--steps", type=positive_int, default=Workload.measured_steps, help="measured steps")
    parser.add_argument("--tolerance-percent", type=positive_float, default=15.0)
    parser.add_argument("--out", default=str(REPO / "results" / "scaling" / "validation-b.csv"), metavar="CSV")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise UsageError(f"argument --out: {out}: exists; nothing written (choose another --out, or --overwrite)")
    reason = missing_reason()
    if reason:
        raise UsageError(f"cannot make the test link here: {reason}")
    workload = Workload(args.arch, args.batch_size, args.image_size, args.warmup_steps, args.steps)
    rows = validate(args.rates, args.hooks, workload, args.tolerance_percent,
                    progress=lambda line: print(line, flush=True))
    write_csv(rows, out, args.overwrite)
    print("\n".join(table_lines(rows)))
    print(f"written {out}")
    return 0 if all(row["within_tolerance"] for row in rows) else 1


if __name__ == "__main__":
    run_main(main)
