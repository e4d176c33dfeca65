"""A scaling model of DDP data-parallel training: predicted step time,
per-GPU throughput and scaling efficiency from 1 to 1,024 GPUs for each DDP
communication hook (none, fp16, bf16, powersgd), and why efficiency falls.

    python -m common.tools.scaling --step-ms 70 -a resnet50 -b 256          # one single-GPU step time
    python -m common.tools.scaling --run runs/<run-dir>                      # ... read from a run directory
    python -m common.tools.scaling --bench results/bench/<file>.csv          # ... or from a bench CSV
    python -m common.tools.scaling --preset upstream-v100-hal                # Validation A: the 2020 V100 runs
    python -m common.tools.scaling --preset h100-8x8                         # ResNet-50 on 64 H100s, with knobs

Units are in names: _ms milliseconds, _bytes bytes, _gbps gigabits per second.
The CSV goes to results/scaling/ (an existing file is never replaced without
--overwrite); the figure (derived, redrawn each time) to figures/scaling_model.png.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import common.tools.scaling.model as scaling_model
from common.arguments import Parser, non_negative_float, positive_float, positive_int
from common.errors import UsageError
from common.tools.scaling.inputs import (links_from_comm_csv, measured_efficiencies, read_csv, settings_from_bench,
                                         settings_from_run)
from common.tools.scaling.model import (DATA_LAYOUTS, DEFAULT_GPUS, HOOKS, IMAGENET_MEAN_IMAGE_BYTES, MIB,
                                        NCCL_RING_NETWORK_LATENCY_US, NCCL_RING_NVLINK_LATENCY_US, Links,
                                        ModelProfile, Settings, assign_buckets, ddp_bucket_caps, gbps_to_bytes,
                                        predict, profile_model)
from common.tools.scaling.presets import H100_STEP_MS, PRESETS, REPO, preset
from common.tools.scaling.report import attach_measured, draw_figure, summary_lines, write_csv_new


def gpu_list(text: str) -> Tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU counts like 1,2,4,8, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive GPU counts, got {text!r}")
    return tuple(sorted(set(counts)))


def bucket_cap(text: str) -> float:
    if text.lower() in ("inf", "one"):
        return math.inf
    return positive_float(text)


def help_text() -> Tuple[str, str]:
    """(description, epilog) of --help: this module's docstring, with the
    model's method (the model module's docstring after its first paragraph)
    between the examples and the units, where a reader of the command looks
    for it."""
    title, examples, outputs = __doc__.split("\n\n")
    method = scaling_model.__doc__.strip("\n").split("\n\n")[1:]
    return title, "\n\n".join([examples, *method, outputs])


def build_parser() -> argparse.ArgumentParser:
    description, epilog = help_text()
    parser = Parser(prog="python -m common.tools.scaling", description=description,
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    what = parser.add_argument_group("what to predict")
    what.add_argument("--preset", action="append", choices=PRESETS, default=None,
                      help="upstream-v100-hal: Validation A against results/upstream; h100-8x8: ResNet-50 on "
                           "H100 nodes with each knob. Repeat for several (one figure panel each)")
    what.add_argument("-a", "--arch", default="resnet50", help="torchvision model (default resnet50)")
    what.add_argument("--image-size", type=positive_int, default=224)
    what.add_argument("--num-classes", type=positive_int, default=1000)
    what.add_argument("-b", "--batch-size", type=positive_int, default=256, help="per GPU")
    what.add_argument("--gpus", type=gpu_list, default=DEFAULT_GPUS, help="GPU counts (default 1,2,4,...,1024)")
    what.add_argument("--baseline-gpus", type=positive_int, default=None,
                      help="efficiency's 100%% (default: the smallest of --gpus)")
    what.add_argument("--hooks", nargs="+", choices=HOOKS, default=list(HOOKS))
    measured = parser.add_argument_group("the measured step (one of)")
    measured.add_argument("--step-ms", type=positive_float, default=None,
                          help="measured step time, data wait included (default 70, an H100's ResNet-50 b256)")
    measured.add_argument("--data-wait-ms", type=non_negative_float, default=0.0, help="of --step-ms")
    measured.add_argument("--measured-gpus", type=positive_int, default=1, help="GPUs the step was measured on")
    measured.add_argument("--measured-hook", choices=HOOKS, default="none")
    measured.add_argument("--run", default=None, metavar="RUN_DIR", help="this project's run directory")
    measured.add_argument("--bench", default=None, metavar="CSV", help="a common.tools.bench CSV")
    measured.add_argument("--bench-config", default=None, metavar="NAME", help="the bench row's config column")
    ddp = parser.add_argument_group("DDP")
    ddp.add_argument("--bucket-cap-mb", type=bucket_cap, default=None,
                     help="DDP's bucket_cap_mb (default: DDP's 25 with a 1 MiB first bucket; 'inf': one bucket)")
    ddp.add_argument("--no-overlap", action="store_true", help="all-reduce after backward (Apex delay_allreduce)")
    ddp.add_argument("--accum-steps", dest="accumulation_steps", type=positive_int, default=1,
                     help="micro-batches per optimizer step (the scripts' --accum-steps): one exchange per step")
    ddp.add_argument("--optimizer-ms", type=non_negative_float, default=0.0)
    ddp.add_argument("--powersgd-rank", type=positive_int, default=1)
    ddp.add_argument("--powersgd-min-compression-rate", type=positive_float, default=2.0)
    links = parser.add_argument_group("interconnect (default: H100 nodes, 8 GPUs, NVLink 4, 8 x NDR 400)")
    links.add_argument("--gpus-per-node", type=positive_int, default=8)
    links.add_argument("--link-gbps", type=positive_float, default=3200.0,
                       help="inter-node bandwidth per node, Gbit/s, all NICs together")
    links.add_argument("--latency-us", type=non_negative_float, default=NCCL_RING_NETWORK_LATENCY_US,
                       help="per ring step across nodes (NCCL's model: 9.6)")
    links.add_argument("--intra-node-gbps", type=positive_float, default=3600.0,
                       help="all-reduce bus bandwidth inside a node, Gbit/s (3600 = 450 GB/s)")
    links.add_argument("--intra-node-latency-us", type=non_negative_float, default=NCCL_RING_NVLINK_LATENCY_US)
    links.add_argument("--comm-csv", default=None, metavar="CSV", help="measured all-reduce rows (overrides)")
    _add_data_flags(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=None, metavar="CSV", help="default results/scaling/<name>.csv")
    out.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    out.add_argument("--figure", default=str(REPO / "figures" / "scaling_model.png"), metavar="PNG")
    out.add_argument("--no-figure", action="store_true")
    out.add_argument("--validation", default=str(REPO / "results" / "scaling" / "validation-b.csv"), metavar="CSV",
                     help="Validation B's CSV (python -m common.tools.link_validation), a last panel of the figure "
                          "when the file exists")
    out.add_argument("--measured", nargs="*", default=None, metavar="LOG_DIR",
                     help="measured runs drawn on the figure (default results/runs: GPU series of several counts)")
    return parser


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    """The data supply: a loader's ceiling, the shared storage, the data's layout and the node-local cache."""
    data = parser.add_argument_group("data supply")
    data.add_argument("--loader-images-per-second", type=positive_float, default=None, help="per GPU")
    data.add_argument("--storage-gbps", type=positive_float, default=None, help="shared file system, all nodes")
    for flag, what in (("--node-storage-gbps", "one node's read bandwidth from the shared storage, Gbit/s"),
                       ("--node-opens-per-second", "files one node may open per second on the shared storage (its "
                                                   "metadata servers' share)"),
                       ("--cache-gbps", "one node's read bandwidth from its local cache, Gbit/s (default: not "
                                        "limiting)")):
        data.add_argument(flag, type=positive_float, default=None, help=what)
    data.add_argument("--data-layout", choices=DATA_LAYOUTS, default="files",
                      help="files: an open per image, every epoch from the storage; shards: the same bytes, no opens "
                           "to speak of; shards+cache: a node-local cache of whole shards (--data-cache), which in "
                           "the first epoch copies every shard to every node (nodes x the bytes from the storage), "
                           "then reads locally; warm-cache: every epoch local (a requeued job)")
    data.add_argument("--epochs", type=positive_int, default=90,
                      help="shards+cache: the step is the mean over these epochs (the first copies, the rest local)")
    data.add_argument("--image-bytes", type=positive_float, default=IMAGENET_MEAN_IMAGE_BYTES)


def settings_from_args(args) -> Settings:
    if sum(x is not None for x in (args.step_ms, args.run, args.bench)) > 1:
        raise UsageError("arguments --step-ms, --run, --bench: give one of them")
    links = Links(args.gpus_per_node, gbps_to_bytes(args.intra_node_gbps), args.intra_node_latency_us * 1e-6,
                  gbps_to_bytes(args.link_gbps), args.latency_us * 1e-6)
    if args.comm_csv:
        links = links_from_comm_csv(Path(args.comm_csv), links)
    settings = Settings(arch=args.arch, image_size=args.image_size, num_classes=args.num_classes,
                        batch_size=args.batch_size, step_ms=args.step_ms or H100_STEP_MS,
                        data_wait_ms=args.data_wait_ms, measured_gpus=args.measured_gpus,
                        measured_hook=args.measured_hook, gpus=args.gpus, baseline_gpus=args.baseline_gpus,
                        hooks=tuple(args.hooks), bucket_cap_mb=args.bucket_cap_mb, overlap=not args.no_overlap,
                        accumulation_steps=args.accumulation_steps, optimizer_ms=args.optimizer_ms,
                        powersgd_rank=args.powersgd_rank,
                        powersgd_min_compression_rate=args.powersgd_min_compression_rate, links=links,
                        loader_images_per_second=args.loader_images_per_second, storage_gbps=args.storage_gbps,
                        node_storage_gbps=args.node_storage_gbps, node_opens_per_second=args.node_opens_per_second,
                        data_layout=args.data_layout, epochs=args.epochs, cache_gbps=args.cache_gbps,
                        image_bytes=args.image_bytes)
    if args.step_ms is not None and args.data_wait_ms + args.optimizer_ms >= args.step_ms:
        raise UsageError(f"argument --data-wait-ms: {args.data_wait_ms:g} ms (plus --optimizer-ms "
                         f"{args.optimizer_ms:g}) leaves no compute in a {args.step_ms:g} ms step")
    if args.run:
        settings = settings_from_run(Path(args.run), settings)
    elif args.bench:
        settings = settings_from_bench(Path(args.bench), args.bench_config, settings)
    if settings.baseline_gpus is not None and settings.baseline_gpus not in settings.gpus:
        raise UsageError(f"argument --baseline-gpus: {settings.baseline_gpus} is not one of --gpus")
    return settings


def main(argv: Optional[Sequence[str]] = None) -> List[Path]:
    args = build_parser().parse_args(argv)
    if args.preset and args.out and len(args.preset) > 1:
        raise UsageError("argument --out: one file, but several --preset (leave --out out)")
    if args.preset:
        jobs = [(name, *preset(name)) for name in dict.fromkeys(args.preset)]
    else:
        settings = settings_from_args(args)
        name = f"{settings.arch}_b{settings.batch_size}_{settings.step_ms:g}ms"
        jobs = [(name, [settings], [Path(p) for p in args.measured] if args.measured is not None
                 else [REPO / "results" / "runs"])]
    outs = [Path(args.out) if args.out else REPO / "results" / "scaling" / f"{name}.csv" for name, _, _ in jobs]
    for path in outs:  # refuse before the slow part
        if path.exists() and not args.overwrite:
            raise UsageError(f"argument --out: {path}: exists; nothing written (choose another --out, or --overwrite)")
    written, panels = [], []
    profiles: Dict[Tuple[str, int, int], ModelProfile] = {}
    for (name, scenarios, measured_dirs), out in zip(jobs, outs):
        rows = []
        for settings in scenarios:
            key = (settings.arch, settings.image_size, settings.num_classes)
            if key not in profiles:
                print(f"tracing {settings.arch} at {settings.image_size} px on the meta device ...", file=sys.stderr)
                profiles[key] = profile_model(*key)
            rows += predict(settings, profiles[key])
        measured = measured_efficiencies(measured_dirs)
        # Measured runs are compared with the rows of the hook they communicated with.
        compared_hook = scenarios[0].measured_hook if scenarios[0].measured_gpus > 1 else scenarios[0].hooks[0]
        attach_measured(rows, measured, compared_hook)
        write_csv_new(out, rows, args.overwrite)
        written.append(out)
        profile = profiles[(scenarios[0].arch, scenarios[0].image_size, scenarios[0].num_classes)]
        buckets = assign_buckets(profile.gradients, *ddp_bucket_caps(scenarios[0].bucket_cap_mb))
        print(f"{name}: {scenarios[0].arch}, {sum(g.numel for g in profile.gradients):,} gradients in "
              f"{len(buckets)} bucket(s) of {', '.join(f'{b.bytes / MIB:.1f}' for b in buckets)} MiB; backward "
              f"{100 * profile.backward_share:.1f}% of the FLOPs; written {out}")
        shown = 64 if 64 in scenarios[0].gpus else max(scenarios[0].gpus)
        print("\n".join(summary_lines(rows, shown)))
        if any(math.isfinite(row["measured_efficiency_percent"]) for row in rows):
            print(f"{'gpus':>5} {'measured_%':>10} {'predicted_%':>11} {'difference_pp':>13}   ({rows[0]['scenario']})")
            for row in rows:
                if math.isfinite(row["measured_efficiency_percent"]) and row["scenario"] == scenarios[0].scenario:
                    print(f"{row['gpus']:>5} {row['measured_efficiency_percent']:10.1f} "
                          f"{row['efficiency_percent']:11.1f} {row['difference_pp']:13.1f}")
        panels.append((f"{name}: {scenarios[0].arch}, b{scenarios[0].batch_size}/GPU, "
                       f"{scenarios[0].links.gpus_per_node} GPUs/node", rows, measured, compared_hook))
    if not args.no_figure:
        validation = read_csv(Path(args.validation), "--validation") if Path(args.validation).is_file() else None
        draw_figure(panels, Path(args.figure), validation)
        print(f"figure: {args.figure}")
        written.append(Path(args.figure))
    return written
