#!/usr/bin/env python3
"""Run an entry script's training on a Ray cluster with Ray Train.

    python run_scripts/ray_train.py --num-workers 2 -- imagenet_ddp.py -a resnet18 DATA
    python run_scripts/ray_train.py --address HEAD:6379 --num-workers 2-8 --use-gpu --max-failures 3 \\
        -- imagenet_ddp_apex.py -a resnet50 --b 208 --opt-level O2 --resume auto DATA

Each Ray Train worker runs the script's own main() with these flags: the same
recipe, loop, run directory, checkpoints and metrics as under torchrun. Ray
has joined the process group (gloo on the CPU, NCCL with --use-gpu) before
the script starts, and gives each worker its rank.

Without --address (or RAY_ADDRESS) a Ray cluster is started on this machine,
sized to it, and stopped at the end. A worker that dies makes Ray restart the
worker group, up to --max-failures times, and --resume auto (which restarts
need) continues from the run's newest checkpoint. --num-workers MIN-MAX lets
Ray restart with fewer workers after losing a node (the script's resume at
another world size counts each image of the epoch once). Each epoch's metrics
also go to Ray (ray.train.report), for its dashboard and for Ray Tune.
docs/launching.md ("Ray") says more.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `common`

from common import ray_cluster  # noqa: E402
from common.arguments import Parser, non_negative_int  # noqa: E402
from common.errors import USAGE_EXIT_STATUS, UsageError, run_main  # noqa: E402


def build_parser() -> Parser:
    parser = Parser(prog="ray_train.py", usage="%(prog)s [options] -- imagenet_ddp.py|imagenet_ddp_apex.py [ARGS...]",
                    description=__doc__.split("\n\n", 1)[0])
    ray_cluster.add_cluster_flags(parser)
    parser.add_argument("--num-workers", metavar="N|MIN-MAX",
                        help="training processes; MIN-MAX: Ray's elastic range, as many as it can place "
                             "(default: the cluster's GPUs with --use-gpu, else 1)")
    parser.add_argument("--max-failures", type=non_negative_int, default=0, metavar="K",
                        help="how many times Ray restarts the worker group after a failure (default 0)")
    return parser


def default_workers(cluster: ray_cluster.Cluster, use_gpu: bool) -> int:
    return max(1, int(cluster.resources().get("GPU", 0))) if use_gpu else 1


def main(argv: Optional[List[str]] = None) -> None:
    ours, command = ray_cluster.split_command(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(ours)
    count = ray_cluster.worker_count(args.num_workers) if args.num_workers is not None else None
    run = ray_cluster.on_devices(ray_cluster.script_run(command), args.use_gpu)
    ray_cluster.check_restarts(run, args.max_failures, count if count is not None else 1)
    with ray_cluster.Cluster(args.address) as cluster:
        count = count if count is not None else default_workers(cluster, args.use_gpu)
        ray_cluster.check_resources(cluster, count, args.use_gpu, args.cpus_per_worker)
        name = ray_cluster.run_name()
        print(f"ray_train.py: {ray_cluster.describe(count)} of {run.path.name} on {cluster.where()}, Ray run "
              f"{name}, --max-failures {args.max_failures}", flush=True)
        trainer = ray_cluster.trainer(run, count, args.use_gpu, args.max_failures, args.cpus_per_worker, name,
                                      args.storage)
        try:
            trainer.fit()
        except SystemExit:  # Ray's own Ctrl-C handler, once it has stopped the run: said as for every script
            raise KeyboardInterrupt from None
        except Exception as error:
            if not ray_cluster.is_training_failure(error):
                raise
            status, line = ray_cluster.how_it_ended(error)
            if status == USAGE_EXIT_STATUS:  # the script's own one line, once (every worker met it)
                raise UsageError(line) from None
            print(f"ray_train.py: error: {line} after --max-failures {args.max_failures} restarts",
                  file=sys.stderr, flush=True)
            sys.exit(status)


if __name__ == "__main__":
    run_main(main)
