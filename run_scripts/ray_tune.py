#!/usr/bin/env python3
"""Search an entry script's recipe with Ray Tune: each trial a whole Ray Train run.

    python run_scripts/ray_tune.py --num-samples 8 --search lr=loguniform:0.05:1.0 \\
        --search warmup-epochs=choice:0,1,5 --scheduler asha --metric val_top1 --workers-per-trial 2 --use-gpu \\
        -- imagenet_ddp_apex.py -a resnet50 --b 208 --opt-level O2 --epochs 16 DATA

--search FLAG=KIND:ARGS draws the script's --FLAG for each trial: loguniform:LOW:HIGH,
uniform:LOW:HIGH, randint:LOW:HIGH (HIGH excluded), choice:A,B,... (drawn) or grid:A,B,...
(every value, --num-samples times). Each trial runs the script through Ray Train with
--workers-per-trial workers, in its own run directory (--run-name <search>-<trial>) with its
config.json and metrics.csv, so common.tools.results and common.tools.plots read the trials as
any runs. Every epoch reports its metrics to Tune; --scheduler asha stops the trials whose
--metric lags at each rung (epochs --grace-epochs x --reduction-factor^k). At the end a table
of the trials (CSV, one row per trial) and the best trial's command line to run it again.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `common`

from common import ray_cluster  # noqa: E402
from common.arguments import Parser, positive_int  # noqa: E402
from common.errors import FAILED_EXIT_STATUS, INTERRUPTED_EXIT_STATUS, USAGE_EXIT_STATUS, UsageError, run_main  # noqa: E402
from common.telemetry import RANKABLE_METRICS  # noqa: E402

TRIAL_CPUS = 0.01
DISTRIBUTIONS = ("loguniform", "uniform", "randint", "choice", "grid")


def build_parser() -> Parser:
    parser = Parser(prog="ray_tune.py", usage="%(prog)s [options] -- imagenet_ddp.py|imagenet_ddp_apex.py [ARGS...]",
                    description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--search", action="append", default=[], metavar="FLAG=KIND:ARGS",
                        help=f"a flag of the script and how to draw it ({', '.join(DISTRIBUTIONS)}); repeatable")
    parser.add_argument("--num-samples", type=positive_int, default=1, metavar="N",
                        help="trials drawn (with grid: repetitions of the whole grid; default 1)")
    parser.add_argument("--metric", default="val_top1",
                        help="what each epoch reports that trials are ranked by (default val_top1)")
    parser.add_argument("--mode", choices=("max", "min"),
                        help="whether more --metric is better (default: min for losses, times and waits, else max)")
    parser.add_argument("--scheduler", choices=("asha", "fifo"), default="asha",
                        help="asha: stop lagging trials early at each rung; fifo: run every trial to the end")
    parser.add_argument("--grace-epochs", type=positive_int, default=1, metavar="E",
                        help="ASHA: epochs every trial runs before it can be stopped (default 1)")
    parser.add_argument("--reduction-factor", type=positive_int, default=2, metavar="R",
                        help="ASHA: keep the best 1/R of the trials at each rung (default 2)")
    parser.add_argument("--workers-per-trial", type=positive_int, default=1, metavar="N",
                        help="Ray Train workers (training processes) of each trial (default 1)")
    parser.add_argument("--max-concurrent-trials", type=positive_int, metavar="N",
                        help="trials that run at once (default: as many as the cluster has room for)")
    parser.add_argument("--out", metavar="CSV",
                        help="the trials table (default: <the script's --logdir>/<search name>.trials.csv)")
    ray_cluster.add_cluster_flags(parser)
    return parser


def parse_search(specs: List[str], run: ray_cluster.ScriptRun) -> List[Tuple[str, str, list]]:
    """--search FLAG=KIND:ARGS as (flag, kind, values), each flag and value
    checked by the script's own parser before anything starts."""
    found: List[Tuple[str, str, list]] = []
    for spec in specs:
        flag, _, rest = spec.partition("=")
        kind, _, args = rest.partition(":")
        flag = flag.strip().lstrip("-")
        if not flag or kind not in DISTRIBUTIONS or not args:
            raise UsageError(f"argument --search: expected FLAG=KIND:ARGS with KIND one of {', '.join(DISTRIBUTIONS)} "
                             f"(e.g. lr=loguniform:0.05:1.0), got {spec!r}")
        if flag in [other for other, _, _ in found]:
            raise UsageError(f"argument --search: --{flag} is searched twice")
        if flag == "run-name":
            raise UsageError("argument --search: --run-name is each trial's own (<search>-<trial>)")
        if kind in ("choice", "grid"):
            values = [value.strip() for value in args.split(",")]
            checked = values
        else:
            low, high = values = _range(spec, kind, args.split(":"))
            checked = [low, high - 1 if kind == "randint" else high]
        for value in checked:  # the script's own parser says what is wrong with a value
            try:
                run.with_flags([f"--{flag}", str(value)])
            except UsageError as error:
                raise UsageError(f"argument --search {spec}: {error}") from None
        found.append((flag, kind, values))
    if not found:
        raise UsageError("argument --search: at least one, e.g. --search lr=loguniform:0.05:1.0")
    return found


def search_space(searched: List[Tuple[str, str, list]]) -> Dict[str, object]:
    """Tune's search space for parse_search's (flag, kind, values)."""
    from ray import tune
    draw = {"loguniform": tune.loguniform, "uniform": tune.uniform, "randint": tune.randint}
    return {flag: (tune.choice(values) if kind == "choice" else tune.grid_search(values) if kind == "grid"
                   else draw[kind](*values)) for flag, kind, values in searched}


def _range(spec: str, kind: str, values: List[str]):
    number = int if kind == "randint" else float
    try:
        low, high = (number(value.strip()) for value in values)
    except ValueError:
        raise UsageError(f"argument --search {spec}: {kind} takes LOW:HIGH, two {number.__name__}s") from None
    if not low < high or (kind == "loguniform" and low <= 0):
        raise UsageError(f"argument --search {spec}: needs LOW < HIGH" + (" and LOW > 0" if kind == "loguniform" else ""))
    return low, high


def default_mode(metric: str) -> str:
    return "min" if any(word in metric for word in ("loss", "seconds", "wait")) else "max"


def main(argv: Optional[List[str]] = None) -> None:
    ours, command = ray_cluster.split_command(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(ours)
    if args.metric not in RANKABLE_METRICS:
        raise UsageError(f"argument --metric: every run reports {', '.join(RANKABLE_METRICS)}; got {args.metric!r}")
    run = ray_cluster.on_devices(ray_cluster.script_run(command), args.use_gpu)
    if run.cfg.run_name is not None:
        raise UsageError("argument --run-name: each trial gets its own run directory (<search>-<trial>); drop it")
    searched = parse_search(args.search, run)
    mode = args.mode or default_mode(args.metric)
    with ray_cluster.Cluster(args.address) as cluster:
        space = search_space(searched)
        ray_cluster.check_resources(cluster, args.workers_per_trial, args.use_gpu, args.cpus_per_worker,
                                    flag="--workers-per-trial", extra_cpus=TRIAL_CPUS)
        at_once = args.max_concurrent_trials or ray_cluster.runs_at_once(
            cluster, args.workers_per_trial, args.use_gpu, args.cpus_per_worker, TRIAL_CPUS)
        name = ray_cluster.run_name("tune")
        out = Path(args.out) if args.out else Path(run.cfg.logdir) / f"{name}.trials.csv"
        print(f"ray_tune.py: search {name}: {args.num_samples} sample(s) of {', '.join(args.search)}, "
              f"{args.workers_per_trial} worker(s) per trial, {at_once} trial(s) at once, {args.scheduler} on "
              f"{args.metric} ({mode}), on {cluster.where()}", flush=True)
        results = search(args, run, searched, space, name, mode, at_once)
        table = ray_cluster.trials_table(results, run, name, args.metric, mode, rerun_flags(args, cluster))
    planned = args.num_samples * math.prod(len(values) for _, kind, values in searched if kind == "grid")
    report(table, out, args.metric, planned)


def report(table, out: Path, metric: str, planned: int) -> None:
    """Write the table of trials and say how the search ended: the best
    trial and its command; every trial failed (the script's own line and
    status 2 where every trial met the same mistake); or interrupted (Ctrl-C:
    Tune stops the trials it runs and starts no more), status 130."""
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    if not table.empty:
        print(table.drop(columns=["command"]).to_string(index=False), flush=True)
    print(f"ray_tune.py: trials table: {out}")
    failed = table[table["exit_status"] != 0] if not table.empty else table
    if len(table) == planned and len(failed) == len(table):  # nothing to rank: the first failure says why
        first = failed.iloc[0]
        line = first["ended"].removeprefix("failed: ")
        if (failed["exit_status"] == USAGE_EXIT_STATUS).all() and (failed["ended"] == first["ended"]).all():
            raise UsageError(line)  # the script's own one line, which every trial met
        print(f"ray_tune.py: error: every trial failed (trial {first['trial']}: {line})", file=sys.stderr)
        sys.exit(int(first["exit_status"]))
    best = table[table["best"]] if not table.empty else table
    if not best.empty:
        row = best.iloc[0]
        print(f"ray_tune.py: best trial {row['trial']}: {metric} {row['best_' + metric]:.4g} "
              f"(run directory {row['run_dir']}); to run it again:\n  {row['command']}", flush=True)
    if len(table) < planned:
        print(f"ray_tune.py: interrupted after {len(table)} of {planned} trials: the table holds what ran",
              file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT_STATUS)
    if best.empty:
        print(f"ray_tune.py: error: no trial reported {metric}", file=sys.stderr)
        sys.exit(FAILED_EXIT_STATUS)


def rerun_flags(args, cluster: ray_cluster.Cluster) -> List[str]:
    """ray_train.py's flags that run one trial again as it ran."""
    flags = ["--num-workers", str(args.workers_per_trial)]
    flags += ["--use-gpu"] if args.use_gpu else []
    flags += ["--cpus-per-worker", f"{args.cpus_per_worker:g}"] if args.cpus_per_worker != 1 else []
    return flags + (["--address", cluster.address] if not cluster.started_here else [])


def trial_folder(trial) -> str:
    """Each trial's folder under --storage is named by its id, as its run directory is (<search>-<id>)."""
    return trial.trial_id


def search(args, run: ray_cluster.ScriptRun, searched, space: dict, name: str, mode: str, at_once: int):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    # ASHA's last rung: the most epochs a trial can run (--epochs itself may be searched).
    epochs = max([run.cfg.epochs] + [int(value) for flag, kind, values in searched if flag == "epochs"
                                     for value in (values if kind in ("choice", "grid") else values[1:])])
    scheduler = (ASHAScheduler(time_attr="training_iteration", max_t=epochs, grace_period=min(args.grace_epochs, epochs),
                               reduction_factor=args.reduction_factor)
                 if args.scheduler == "asha" else FIFOScheduler())
    trial = ray_cluster.tune_trial(run, args.workers_per_trial, args.use_gpu, args.cpus_per_worker, name,
                                   args.storage)
    # The trial function only starts its Ray Train run and waits: it takes (almost) no CPU from the workers
    # (Tune asks for some resource).
    tuner = tune.Tuner(tune.with_resources(trial, {"cpu": TRIAL_CPUS}), param_space=space,
                       tune_config=tune.TuneConfig(metric=args.metric, mode=mode, num_samples=args.num_samples,
                                                   scheduler=scheduler,
                                                   max_concurrent_trials=at_once,
                                                   trial_dirname_creator=trial_folder),
                       run_config=tune.RunConfig(name=name, storage_path=args.storage,
                                                 verbose=0))
    return tuner.fit()


if __name__ == "__main__":
    run_main(main)
