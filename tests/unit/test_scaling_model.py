"""common.tools.scaling: the all-reduce formula, the hooks' bytes, DDP's bucket
layout (against a real one-process DDP), the overlap of communication with
backward on hand-built cases, and the command's files and one-line mistakes."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from common.errors import UsageError
from common.files import TEMPORARY_NAME
from common.tools import scaling
from common.tools.scaling import Bucket, Gradient, Links, ModelProfile, Settings
from helpers import REPO, csv_rows

COMMAND = [sys.executable, "-m", "common.tools.scaling"]


def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def hand_profile(*gradients: Gradient) -> ModelProfile:
    """Forward 1 FLOP, backward 2: backward is 2/3 of the compute."""
    return ModelProfile("hand", 0, 1.0, 2.0, tuple(gradients))


def test_ring_allreduce_formula_on_known_values():
    # 2(n-1)/n * S / busbw + 2(n-1) * latency: 1.5 * 1 GB / 100 GB/s = 15 ms, 6 steps * 5 us = 0.03 ms.
    assert scaling.ring_allreduce_ms(1e9, 4, 100e9, 5e-6) == pytest.approx(15.03)
    assert scaling.ring_allreduce_ms(1e9, 1, 100e9, 5e-6) == 0.0
    links = Links(gpus_per_node=4, intra_node_bytes_per_second=100e9, intra_node_latency_seconds=2e-6,
                  inter_node_bytes_per_second=10e9, inter_node_latency_seconds=10e-6)
    assert links.allreduce_ms(8e6, 4) == pytest.approx(1000 * (1.5 * 8e6 / 100e9 + 6 * 2e-6))  # one node
    # 8 GPUs on 2 nodes: the network link paces the ring; 14 steps, 2 of them across nodes.
    assert links.allreduce_ms(8e6, 8) == pytest.approx(1000 * (1.75 * 8e6 / 10e9 + 12 * 2e-6 + 2 * 10e-6))
    assert scaling.gbps_to_bytes(100) == 12.5e9


def test_hook_bytes_fp16_halves_and_powersgd_by_hand():
    # A tiny model: Linear(10, 20) then Linear(20, 3); fp32 parameters, in backward's order.
    weights = [Gradient("1.weight", (3, 20), 4, 0.2), Gradient("1.bias", (3,), 4, 0.2),
               Gradient("0.weight", (20, 10), 4, 1.0), Gradient("0.bias", (20,), 4, 1.0)]
    bucket = Bucket(tuple(weights))
    assert bucket.bytes == 4 * (60 + 3 + 200 + 20)
    assert scaling.collective_bytes(bucket, "none") == [bucket.bytes]
    assert scaling.collective_bytes(bucket, "fp16") == [bucket.bytes // 2]
    assert scaling.collective_bytes(bucket, "bf16") == [bucket.bytes // 2]
    # Rank 1, min_compression_rate 2: 20x10: (20+10)*2 = 60 < 200, compressed (P 20, Q 10); 3x20: 46 < 60,
    # compressed (P 3, Q 20); the biases (n x 1) never are: 23 uncompressed. Three all-reduces, fp32.
    assert scaling.collective_bytes(bucket, "powersgd", powersgd_rank=1, min_compression_rate=2) == \
        [4 * 23, 4 * (20 + 3), 4 * (10 + 20)]
    # Rank 4: 3x20 needs (3+20)*3*2 = 138 >= 60 (rank capped at 3): sent whole; 20x10: (30)*4*2 = 240 >= 200: whole.
    assert scaling.collective_bytes(bucket, "powersgd", powersgd_rank=4) == [bucket.bytes]


def test_bucket_caps_follow_torch():
    assert scaling.ddp_bucket_caps(None) == (1 << 20, 25 << 20)  # default: a 1 MiB first bucket
    assert scaling.ddp_bucket_caps(100) == (100 << 20, 100 << 20)  # an explicit cap is every bucket's
    sizes = [Gradient(str(i), (n,), 4, i / 4) for i, n in enumerate((100_000, 200_000, 300_000, 7_000_000, 10))]
    buckets = scaling.assign_buckets(sizes, 1 << 20, 2 << 20)
    # 400 kB, then +800 kB = 1.2 MB >= 1 MiB closes the first; 1.2 MB, +28 MB closes the next; 40 B is left.
    assert [b.bytes for b in buckets] == [1_200_000, 29_200_000, 40]
    assert [b.ready_fraction for b in buckets] == [0.25, 0.75, 1.0]


DDP_PROBE = """
import json, sys, tempfile, torch, torchvision, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
torch.set_num_threads(1)  # tiny tensors: more threads only contend on a busy 2-core machine
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
found = {}
for arch, cap in (("resnet18", None), ("mobilenet_v2", None), ("resnet18", 5)):
    torch.manual_seed(0)
    model = DistributedDataParallel(torchvision.models.get_model(arch, weights=None, num_classes=10),
                                    bucket_cap_mb=cap)
    images = torch.randn(2, 3, 16, 16)
    for _ in range(3):  # DDP rebuilds its buckets in gradient-ready order after the first backward
        model(images).sum().backward()
    data = model._get_ddp_logging_data()
    found[f"{arch} {cap}"] = [int(size) for size in data["rebuilt_bucket_sizes"].split(",")]
print(json.dumps(found))
"""


def test_bucket_layout_equals_real_ddp():
    probe = subprocess.Popen([sys.executable, "-c", DDP_PROBE], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    profiles = {arch: scaling.profile_model(arch, image_size=16, num_classes=10)  # while real DDP runs
                for arch in ("resnet18", "mobilenet_v2")}
    stdout, stderr = probe.communicate(timeout=120)
    assert probe.returncode == 0, stderr[-2000:]
    real = json.loads(stdout.strip().splitlines()[-1])
    for key, sizes in real.items():
        arch, cap = key.split()
        caps = scaling.ddp_bucket_caps(None if cap == "None" else float(cap))
        assert [bucket.bytes for bucket in scaling.assign_buckets(profiles[arch].gradients, *caps)] == sizes, key
    assert len(real["resnet18 None"]) == 3 and len(real["mobilenet_v2 None"]) >= 2  # not a trivial one-bucket case


def two_bucket_case(first_bytes: float, second_bytes: float, second_ready: float = 1.0):
    """Gradients ready at half and (by default) at the end of backward, one bucket each;
    2 GPUs in a node at 1 GB/s and no latency: S bytes take S / 1e6 ms."""
    profile = hand_profile(Gradient("late layer", (int(first_bytes // 4),), 4, 0.5),
                           Gradient("first layer", (int(second_bytes // 4),), 4, second_ready))
    buckets = scaling.assign_buckets(profile.gradients, 1, 1)
    settings = Settings(links=Links(8, 1e9, 0.0, 1e9, 0.0), batch_size=10)
    return settings, profile, buckets


def test_exposed_comm_overlap_by_hand():
    # 30 ms of compute: forward 10, backward 20 (2/3). Bucket A is ready at 20 ms, bucket B at 30 ms.
    settings, profile, buckets = two_bucket_case(8e6, 4e6)  # A takes 8 ms (20 -> 28), B 4 ms (30 -> 34)
    step = scaling.predict_step(settings, profile, buckets, "none", 2, compute_ms=30.0)
    assert step.comm_ms == pytest.approx(12.0) and step.exposed_comm_ms == pytest.approx(4.0)
    assert step.step_ms == pytest.approx(34.0)
    settings, profile, buckets = two_bucket_case(15e6, 4e6)  # A 20 -> 35, B waits for it: 35 -> 39
    step = scaling.predict_step(settings, profile, buckets, "none", 2, compute_ms=30.0)
    overlap = 30.0 - 20.0  # communication hidden behind backward
    assert step.exposed_comm_ms == pytest.approx(step.comm_ms - overlap) == pytest.approx(9.0)
    # Communication much faster than backward: all of it hides behind backward (the last bucket ready at 90%).
    fast, fast_profile, fast_buckets = two_bucket_case(8e6, 4e6, second_ready=0.9)
    fast = replace_links(fast, 1e12)  # 12 MB in 0.012 ms; backward has 2 ms left after the last bucket is ready
    assert scaling.predict_step(fast, fast_profile, fast_buckets, "none", 2, 30.0).exposed_comm_ms == 0.0
    # No overlap (Apex delay_allreduce): all of it is exposed.
    serial = scaling.predict_step(Settings(links=settings.links, overlap=False), profile, buckets, "none", 2, 30.0)
    assert serial.exposed_comm_ms == pytest.approx(19.0)
    # Two accumulation steps: one all-reduce per 2 micro-batches, so half the exposed time per micro-batch.
    twice = scaling.predict_step(Settings(links=settings.links, accumulation_steps=2), profile, buckets, "none", 2, 30.0)
    assert twice.exposed_comm_ms == pytest.approx(9.0 / 2) and twice.step_ms == pytest.approx(30.0 + 4.5)


def replace_links(settings: Settings, bytes_per_second: float) -> Settings:
    from dataclasses import replace
    return replace(settings, links=Links(8, bytes_per_second, 0.0, bytes_per_second, 0.0))


def test_one_gpu_has_no_comm_and_efficiency_falls_monotonically():
    profile = hand_profile(*(Gradient(f"g{i}", (3_000_000,), 4, (i + 1) / 8) for i in range(8)))
    settings = Settings(step_ms=50.0, data_wait_ms=5.0, links=Links(8, 100e9, 3e-6, 25e9, 10e-6))
    rows = scaling.predict(settings, profile)
    for hook in scaling.HOOKS:
        table = [row for row in rows if row["hook"] == hook]
        one = table[0]
        assert one["gpus"] == 1 and one["comm_ms"] == 0 and one["exposed_comm_ms"] == 0
        assert one["efficiency_percent"] == pytest.approx(100.0) and one["step_ms"] == pytest.approx(50.0)
        assert one["data_wait_ms"] == pytest.approx(5.0) and one["compute_ms"] == pytest.approx(45.0)
        efficiencies = [row["efficiency_percent"] for row in table]
        assert all(b <= a + 1e-9 for a, b in zip(efficiencies, efficiencies[1:])), (hook, efficiencies)
        assert efficiencies[-1] < 100.0
    # A step measured at 2 GPUs: the model's own communication there comes off the compute time.
    measured_at_two = scaling.predict(Settings(step_ms=50.0, measured_gpus=2, gpus=(2, 4), links=settings.links,
                                               hooks=("none",)), profile)
    assert measured_at_two[0]["step_ms"] == pytest.approx(50.0, abs=1e-6)


def test_storage_and_loader_ceilings():
    profile = hand_profile(Gradient("g", (10,), 4, 1.0))
    # 64 GPUs x 100 images x 1 MB at 8 Gbit/s (1 GB/s): 6.4 s a step, whatever the compute.
    settings = Settings(step_ms=100.0, batch_size=100, gpus=(1, 64), storage_gbps=8.0, image_bytes=1e6,
                        hooks=("none",))
    rows = scaling.predict(settings, profile)
    assert rows[1]["step_ms"] == pytest.approx(6400.0)
    assert rows[1]["data_wait_ms"] == pytest.approx(6400.0 - rows[1]["compute_ms"] - rows[1]["exposed_comm_ms"])
    loader = scaling.predict(Settings(step_ms=100.0, batch_size=100, gpus=(1,), loader_images_per_second=500.0,
                                      hooks=("none",)), profile)
    assert loader[0]["step_ms"] == pytest.approx(200.0) and loader[0]["data_wait_ms"] == pytest.approx(100.0)


# 8 GPUs a node; 100 images of 1 MB per GPU and step: a node's GPUs take 800 images, 800 MB a step.
NODES_OF_8 = Links(8, 450e9, 0.0, 50e9, 0.0)
STORAGE_STEP = dict(step_ms=100.0, batch_size=100, image_bytes=1e6, links=NODES_OF_8, hooks=("none",))


def test_storage_per_node_opens_and_bandwidth_by_data_layout():
    files = Settings(**STORAGE_STEP, node_opens_per_second=1000.0, node_storage_gbps=16.0)  # 2 GB/s a node
    # Files: 800 opens at 1,000/s = 800 ms; 800 MB at 2 GB/s = 400 ms: the opens bound it, at 8 GPUs and 64 alike.
    assert scaling.supply_ms_by_epoch(files, 64, 100) == pytest.approx((800.0, 800.0))
    assert scaling.supply_ms_by_epoch(files, 8, 100) == pytest.approx((800.0, 800.0))
    assert scaling.supply_ms_by_epoch(files, 2, 100) == pytest.approx((200.0, 200.0))  # one node, 2 GPUs: 200 opens
    # Shards: the same bytes, no opens: the node's bandwidth bounds it.
    shards = Settings(**dict(STORAGE_STEP, node_opens_per_second=1000.0, node_storage_gbps=16.0, data_layout="shards"))
    assert scaling.supply_ms_by_epoch(shards, 64, 100) == pytest.approx((400.0, 400.0))
    # The shared storage's bandwidth for all nodes: 64 GPUs x 100 x 1 MB at 8 Gbit/s (1 GB/s) = 6.4 s, any layout.
    assert scaling.supply_ms_by_epoch(Settings(**STORAGE_STEP, storage_gbps=8.0), 64, 100) == pytest.approx(
        (6400.0, 6400.0))


def test_shards_and_a_node_cache_copy_everything_to_every_node_in_the_first_epoch_then_read_locally():
    profile = hand_profile(Gradient("g", (10,), 4, 1.0))
    cached = Settings(**STORAGE_STEP, gpus=(8, 64), storage_gbps=8.0, data_layout="shards+cache", epochs=10,
                      cache_gbps=16.0)
    # Epoch 1: 8 nodes each copy the 6.4 GB the 64 GPUs take a step: 51.2 GB at 1 GB/s. Later: 800 MB a node
    # from its own disk at 2 GB/s, 400 ms.
    assert scaling.supply_ms_by_epoch(cached, 64, 100) == pytest.approx((51200.0, 400.0))
    assert scaling.supply_ms_by_epoch(cached, 8, 100) == pytest.approx((800.0, 400.0))  # one node: no copies more
    unlimited = {row["gpus"]: row["step_ms"] for row in scaling.predict(Settings(**STORAGE_STEP, gpus=(8, 64)),
                                                                        profile)}
    steps = {row["gpus"]: row["step_ms"] for row in scaling.predict(cached, profile)}
    assert unlimited[64] < 400.0  # the model's own step is faster than the cache: the cache bounds later epochs
    assert steps[64] == pytest.approx((51200.0 + 9 * 400.0) / 10)
    assert steps[8] == pytest.approx((800.0 + 9 * 400.0) / 10)
    warm = scaling.predict(replace(cached, data_layout="warm-cache"), profile)
    assert [row["step_ms"] for row in warm] == pytest.approx([400.0, 400.0])


def test_the_upstream_run_with_shards_and_a_node_cache():
    """The 64-GPU run's storage (3.93 GB/s) behind shards and a node-local cache: the first of 90 epochs copies
    the dataset to all 16 nodes (16 x the 389.4 ms step of the plain ceiling), the other 89 take the
    communication-bound 271.0 ms step: (16 x 389.4 + 89 x 271.0) / 90 = 337 ms, 78% (measured without: 65.1%)."""
    scenarios, _ = scaling.preset("upstream-v100-hal")
    profile = scaling.profile_model("resnet50", 224, 1000)
    ceiling, cached, warm = ({row["gpus"]: row for row in scaling.predict(settings, profile) if row["hook"] == "fp16"}
                             for settings in scenarios[1:])  # Apex O2's fp16 gradients, as the run sent them
    assert ceiling[64]["step_ms"] == pytest.approx(389.4, abs=0.1)
    expected = (16 * ceiling[64]["step_ms"] + 89 * warm[64]["step_ms"]) / 90
    assert cached[64]["step_ms"] == pytest.approx(expected, rel=1e-6)
    assert cached[64]["step_ms"] == pytest.approx(337.0, abs=1.0)
    assert cached[64]["efficiency_percent"] == pytest.approx(78.0, abs=0.5)
    assert warm[64]["efficiency_percent"] == pytest.approx(97.1, abs=0.1)


def test_comm_csv_reader_is_tolerant(tmp_path):
    path = tmp_path / "comm.csv"
    path.write_text("section,scope,bytes,busbw_GBps,latency_us,ranks\n"
                    "train,,1,1,1,1\n"  # another section: ignored
                    "comm,intra,1024,5,30,8\ncomm,intra,1073741824,400,9000,8\n"
                    "comm,inter,1024,2,140,16\ncomm,inter,1073741824,48,40000,16\n")
    links = scaling.links_from_comm_csv(path, scaling.H100_LINKS)
    assert links.intra_node_bytes_per_second == 400e9 and links.inter_node_bytes_per_second == 48e9
    assert links.intra_node_latency_seconds == pytest.approx(30e-6 / 14)
    assert links.inter_node_latency_seconds == pytest.approx(140e-6 / 30)
    gbits = tmp_path / "gbits.csv"
    gbits.write_text("bytes,busbw_gbps,nodes\n1000000000,800,2\n")
    assert scaling.links_from_comm_csv(gbits, scaling.H100_LINKS).inter_node_bytes_per_second == 100e9


def test_upstream_validation_numbers():
    """Validation A: the comm model alone keeps 97% at 64 GPUs; upstream measured 65%."""
    (base, storage, *with_a_node_cache), measured_dirs = scaling.preset("upstream-v100-hal")
    assert (base.batch_size, base.measured_gpus, base.overlap) == (208, 2, False)
    assert base.step_ms == pytest.approx(263.0, abs=0.5)  # the 2-GPU run's mean Time/train
    measured = scaling.measured_efficiencies(measured_dirs)
    (points,) = measured.values()
    assert points[64] == pytest.approx(65.1, abs=0.1) and points[8] == pytest.approx(91.7, abs=0.1)


def test_command_writes_csv_and_figure_and_refuses_to_overwrite(tmp_path):
    out, figure = tmp_path / "scaling" / "r18.csv", tmp_path / "scaling_model.png"
    args = ["-a", "resnet18", "--image-size", "32", "--step-ms", "50", "--gpus", "1,2,16", "--out", str(out),
            "--figure", str(figure), "--measured"]
    done = run(*args)
    assert done.returncode == 0, done.stderr
    rows = csv_rows(out)
    assert len(rows) == 4 * 3 and rows[0]["hook"] == "none" and rows[0]["gpus"] == "1"
    assert float(rows[0]["efficiency_percent"]) == 100.0 and float(rows[0]["exposed_comm_ms"]) == 0.0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = out.read_bytes()
    again = run(*args)
    assert again.returncode == 2 and out.read_bytes() == before
    assert len(again.stderr.strip().splitlines()) == 1 and "exists" in again.stderr and str(out) in again.stderr
    assert not [p for p in out.parent.iterdir() if TEMPORARY_NAME.match(p.name)]  # no temporary file left


@pytest.mark.parametrize("args, named", [
    (["--gpus", "0,2"], "--gpus"),
    (["--run", "/no/such/run"], "/no/such/run"),
    (["--bench", "/no/such/bench.csv"], "/no/such/bench.csv"),
    (["--step-ms", "-3"], "--step-ms"),
    (["--step-ms", "10", "--data-wait-ms", "20", "--no-figure", "--out", "/tmp/never-written.csv"], "--data-wait-ms"),
    (["--preset", "nope"], "--preset"),
])
def test_mistakes_are_one_line_and_status_2(args, named):
    done = run(*args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert named in done.stderr


def test_help_works():
    done = run("--help")
    assert done.returncode == 0 and "--bucket-cap-mb" in done.stdout and "--preset" in done.stdout


def test_the_storage_flags_reach_the_settings():
    from common.tools.scaling.command_line import settings_from_args

    args = scaling.build_parser().parse_args(["--step-ms", "100", "--node-storage-gbps", "8", "--node-opens-per-second",
                                              "1000", "--data-layout", "shards+cache", "--epochs", "10",
                                              "--cache-gbps", "16"])
    settings = settings_from_args(args)
    assert (settings.node_storage_gbps, settings.node_opens_per_second, settings.data_layout, settings.epochs,
            settings.cache_gbps) == (8.0, 1000.0, "shards+cache", 10, 16.0)
    defaults = settings_from_args(scaling.build_parser().parse_args(["--step-ms", "100"]))
    assert (defaults.data_layout, defaults.epochs, defaults.node_opens_per_second) == ("files", 90, None)
    with pytest.raises(UsageError, match="--data-layout"):
        scaling.build_parser().parse_args(["--data-layout", "tar"])
