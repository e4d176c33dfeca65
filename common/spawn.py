"""Starting the training processes of this node: `start` runs
`train(cfg, ctx)` in this process when a launcher made it one worker, or
spawns one worker per GPU and watches them, following the plan of
common.launcher. A worker that fails stops its local peers; Ctrl-C or
SIGTERM stops them all; workers and their data-loading processes die with
their parent (common.process_signals), so no process outlives the job. Each
worker joins the process group (common.rendezvous) and leaves it at the end.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from common import lazy
from common.config import Config
from common.distributed import Context
from common.errors import (DATA_TIMEOUT_EXIT_STATUS, FAILED_EXIT_STATUS, INTERRUPTED_EXIT_STATUS,
                           NONFINITE_EXIT_STATUS, PEER_LOST_EXIT_STATUS, STOPPED_EXIT_STATUS, USAGE_EXIT_STATUS,
                           WRITE_FAILED_EXIT_STATUS, ReportedError, error_summary, exit_status, program,
                           skip_final_collection, without_credentials)
from common.launcher import Launch, check_before_start, discover, ray_train_context
from common.process_signals import (children_of, die_with_parent, dump_stacks_on_quit, ignore_stop_signals_until_training,
                                    stuck_state)
from common.rendezvous import check_gpu_binding, join_process_group, roll_call, roll_call_seconds

WORKER_STOP_GRACE_SECONDS = 3.0  # after a worker fails, how long its peers get to exit (and report) on their own
WORKER_KILL_SECONDS = 5.0  # after SIGTERM, how long a worker gets before SIGKILL
STACK_DUMP_SECONDS = 2.0  # after SIGQUIT, how long a worker that stopped answering gets to write its stacks


# What a collective raises when a peer process has gone (gloo, NCCL): the peer's own output says why.
_PEER_LOSS_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                       "NCCL communicator was aborted", "remote process exited or there was a network error")
# ... and when a peer did not answer within --dist-timeout (gloo's collectives, c10d's store): it stopped or hangs.
# gloo says the second when the time ran out in a collective DDP started during backward (its pair is closed).
_PEER_TIMEOUT_MESSAGES = ("Timed out waiting", "Application timeout caused pair closure", "Socket Timeout",
                          "wait timeout after")


def _lost_a_peer(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_LOSS_MESSAGES)


def _peer_timed_out(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_TIMEOUT_MESSAGES)


def _run_worker(train: Callable[[Config, Context], None], cfg: Config, launch: Launch, local_rank: int,
                spawned: bool = False) -> None:
    """Join the process group, check that no two ranks share a GPU, train,
    leave. A peer that stopped answering (a collective timed out) is one
    line: which rank, and when this process last heard from it. One that
    failed is one line too (under a launcher: its log is the place to look)
    or, in a worker this script spawned, a quiet exit for the spawner to
    report: not a second traceback beside the one that matters."""
    rank = launch.rank if launch.rank is not None else launch.rank_of(local_rank)
    ctx = join_process_group(cfg, launch, rank, local_rank)
    try:
        check_gpu_binding(ctx)  # inside: a peer lost meanwhile is told as in training
        train(cfg, ctx)
    except RuntimeError as error:
        timed_out = _peer_timed_out(error)
        if not timed_out and not _lost_a_peer(error):
            raise
        if timed_out or not spawned:
            print(f"{program()}: error: rank {rank}: {_peer_loss_line(error, timed_out, cfg, launch, ctx)}",
                  file=sys.stderr, flush=True)
        sys.exit(PEER_LOST_EXIT_STATUS)
    finally:
        if launch.launcher != "ray":  # Ray Train leaves the group it joined
            dist.destroy_process_group()


def _peer_loss_line(error: BaseException, timed_out: bool, cfg: Config, launch: Launch, ctx: Context) -> str:
    """What a process that lost a peer says: which rank (of two, the other;
    of more, those that do not answer a roll call, after a timeout), what
    the collective raised, and when it last heard from it."""
    said = re.sub(r"^\[[^\]]*\]\s*", "", error_summary(error))  # without gloo's source file and line
    heard = f"last heard from it {ctx.contact.describe()}"
    if not timed_out:
        whom = f"rank {1 - ctx.rank}" if ctx.world_size == 2 else "another process"
        return f"lost the connection to {whom} ({said}); it failed or was stopped: its output says why; {heard}"
    if ctx.world_size == 2:
        whom = f"rank {1 - ctx.rank}"
    else:
        silent = roll_call(ctx.rank, ctx.world_size, roll_call_seconds(cfg.dist_timeout))
        if silent is None:
            whom = ("rank 0, whose rendezvous store does not answer either" if launch.agent_store is None
                    else "another process; the rendezvous store does not answer either")
        else:
            ranks = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
            whom = ranks if silent else "a process that answered again later"
    return (f"lost {whom}: no answer within --dist-timeout {cfg.dist_timeout:g} s ({said}); {heard}; it stopped "
            f"or hangs: its output, or its node's, may say why")


def _spawned_worker(local_rank: int, train, cfg: Config, launch: Launch) -> None:
    die_with_parent()
    # A process started by the spawn context inherits "spawn" as its default start method, so its
    # DataLoader workers would be spawned too: every epoch, for training and again for validation,
    # each of them importing torch afresh. Measured: the digits demo's epoch took about 20 s instead
    # of 2.6 on the H200 machine, and 3 short epochs 48 s instead of 3.5 on 2 CPU cores. Forgetting it
    # makes them fork, as under torchrun and in imagenet_nd.py.
    multiprocessing.set_start_method(None, force=True)
    # Until training starts (and asks for a clean stop instead), SIGTERM unwinds as for Ctrl-C, so
    # data-loading processes and their shared-memory queues are cleaned up (SIGKILL follows if this
    # takes too long).
    signal.signal(signal.SIGTERM, _interrupt)
    ignore_stop_signals_until_training()
    dump_stacks_on_quit()
    try:
        # What the script stands in for (common/lazy.py), before the process group's threads: seconds, in
        # which a stop signal is an interruption too (a quiet exit, not a traceback from inside an import).
        lazy.import_now()
        _run_worker(train, cfg, launch, local_rank, spawned=True)
    except (ReportedError, KeyboardInterrupt) as error:
        # Ctrl-C reaches every process of the terminal: the spawner says it, not each worker.
        sys.exit(exit_status(error, launch.rank_of(local_rank), local_rank, say_interrupted=False))
    finally:
        skip_final_collection()


def _dump_stacks(worker, stopped: bool) -> None:
    """Where a worker that stopped answering, and its data-loading workers, wait: each writes its threads'
    stacks to stderr on SIGQUIT (process_signals.dump_stacks_on_quit), a moment before it is killed. A
    stopped process could not: nothing is asked of it."""
    if stopped:
        return
    print(f"{program()}: the stacks of worker {worker.name} (pid {worker.pid}) and of its data-loading workers "
          f"follow, where each thread waited:", file=sys.stderr, flush=True)
    for pid in (worker.pid, *children_of(worker.pid)):
        try:
            os.kill(pid, signal.SIGQUIT)
        except ProcessLookupError:  # it exited meanwhile
            pass
    time.sleep(STACK_DUMP_SECONDS)


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _stop(processes) -> None:
    """SIGTERM every live worker, then SIGKILL what is still alive after a grace period."""
    processes = [process for process in processes if process.pid is not None]  # Ctrl-C may come mid-start
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + WORKER_KILL_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _spawn_and_watch(train, cfg: Config, launch: Launch) -> None:
    """Start this node's workers and wait for them. The first failure stops
    the rest (after a moment to exit on their own) and sets the exit status.
    Stop signals (SIGTERM, --preempt-signal) are passed on to the workers,
    which stop cleanly together; a second one, or Ctrl-C, stops them at once."""
    spawn = multiprocessing.get_context("spawn")  # fork would copy a CUDA-initialised parent
    workers = [spawn.Process(target=_spawned_worker, args=(local_rank, train, cfg, launch),
                             name=f"rank{launch.rank_of(local_rank)}")
               for local_rank in range(launch.procs_per_node)]

    signals_received = []
    told = set()  # the workers a stop signal was passed on to

    def tell(signum) -> None:
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None and worker.pid not in told:
                told.add(worker.pid)
                try:
                    os.kill(worker.pid, signum)
                except ProcessLookupError:  # it exited meanwhile
                    pass

    def pass_on(signum, frame):
        signals_received.append(signum)
        if len(signals_received) > 1:  # asked twice: stop now (a hung job must still be stoppable)
            raise KeyboardInterrupt
        tell(signum)

    stop_signals = {signal.SIGTERM, signal.Signals[cfg.preempt_signal]}
    previous = {signum: signal.signal(signum, pass_on) for signum in stop_signals}
    try:
        for worker in workers:
            worker.start()
        # A stop that came while they were being started reaches those not started then (a loaded 2-core
        # machine in CI: both workers then trained on, the stop lost).
        if signals_received:
            tell(signals_received[0])
        # After a peer timed out, the others of more than two run a roll call before they exit (common.rendezvous).
        _watch(workers, signals_received, roll_call_seconds(cfg.dist_timeout) if launch.world_size > 2 else 0.0,
               cfg.dist_timeout)
    except KeyboardInterrupt:
        _stop(workers)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _watch(workers, signals_received=(), roll_call_seconds: float = 0.0, dist_timeout: Optional[float] = None) -> None:
    """Wait until every worker has exited with status 0 (or all stopped
    cleanly on a signal: then exit with STOPPED_EXIT_STATUS), or report the
    first failure (which stops the others and exits; see _report_failure).
    `signals_received`: the stop signals passed on to the workers so far."""
    running = list(workers)
    stopped = False
    while running:
        multiprocessing.connection.wait([worker.sentinel for worker in running])
        # Read each exit code once: a read as None (not yet reaped) and then as 2 by a second read
        # would drop a failed worker without reporting it, and the job would exit 0.
        exit_codes = [(worker, worker.exitcode) for worker in running]
        stopped = stopped or any(code == STOPPED_EXIT_STATUS for _, code in exit_codes)
        running = [worker for worker, code in exit_codes if code is None]
        if _failures(exit_codes):
            _report_failure(workers, running, signals_received, roll_call_seconds, dist_timeout)
    if stopped:
        sys.exit(STOPPED_EXIT_STATUS)


def _failures(exit_codes):
    """The (worker, exit code) pairs of workers that ended with an error (not done, nor stopped cleanly)."""
    return [(worker, code) for worker, code in exit_codes if code not in (None, 0, STOPPED_EXIT_STATUS)]


def _first_cause(failed):
    """Of workers that ended together, the one to name: one killed by a signal
    before one that exited with an error status, and either before one that
    only lost its connection to them."""
    return min(failed, key=lambda pair: (pair[1] >= 0, pair[1] == PEER_LOST_EXIT_STATUS))[0]


def _wait_for_exits(workers, seconds: float) -> None:
    """Wait until every one of `workers` has exited, or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while workers and time.monotonic() < deadline:
        ended = multiprocessing.connection.wait([worker.sentinel for worker in workers], deadline - time.monotonic())
        for worker in workers:
            if worker.sentinel in ended:
                worker.join()  # it is gone; reaped now (its pipe closes a moment before), its exit code known
        workers = [worker for worker in workers if worker.exitcode is None]


def _report_failure(workers, running, signals_received, roll_call_seconds: float,
                    dist_timeout: Optional[float]) -> None:
    """Name the worker that failed first, stop the others, exit. When the
    failures only lost a peer, a worker that is still running after their
    grace (and roll call) is the one that stopped answering: named, with
    what /proc says of it, and killed (its peers are gone: no clean stop is
    left to it); the exit status is then PEER_LOST_EXIT_STATUS."""
    if running:  # a moment for the others to exit on their own (they often fail on the broken connection)
        peer_lost = _first_cause(_failures([(worker, worker.exitcode) for worker in workers])).exitcode == \
            PEER_LOST_EXIT_STATUS
        _wait_for_exits(running, WORKER_STOP_GRACE_SECONDS + (roll_call_seconds if peer_lost else 0))
    ended = [(worker, worker.exitcode) for worker in workers]
    failed = _first_cause(_failures(ended))
    silent = [worker for worker, code in ended if code is None]
    code = failed.exitcode
    if code == PEER_LOST_EXIT_STATUS and silent:
        for worker in silent:
            state = stuck_state(worker.pid)
            state, after = f" (its state: {state})" if state else "", f" {dist_timeout:g} s" if dist_timeout else ""
            print(f"{program()}: error: worker {worker.name} stopped answering{state}: its peers gave up on it after "
                  f"--dist-timeout{after}; killed it and stopped the other workers of this node",
                  file=sys.stderr, flush=True)
            _dump_stacks(worker, stopped=bool(state))
            worker.kill()
        _stop(workers)
        sys.exit(PEER_LOST_EXIT_STATUS)
    _stop(silent)
    # A UsageError, a NaN loss, a checkpoint the run could not write, a batch that did not come: the worker said it.
    if code in (USAGE_EXIT_STATUS, NONFINITE_EXIT_STATUS, WRITE_FAILED_EXIT_STATUS, DATA_TIMEOUT_EXIT_STATUS):
        sys.exit(code)
    # A worker still starting when a stop signal was passed on ends by it (or as on Ctrl-C, once its handler
    # is in place): the job was stopped, as asked, before training could save anything; no worker failed.
    if code == INTERRUPTED_EXIT_STATUS or -code in signals_received:
        raise KeyboardInterrupt
    how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
    if code == PEER_LOST_EXIT_STATUS:
        how = "lost its connection to another process (one on another node failed or was stopped?)"
    if code == -signal.SIGKILL:
        how += " (by the kernel's out-of-memory killer, if nobody sent it)"
    print(f"{program()}: error: worker {failed.name} {how}; stopped the other workers of this node",
          file=sys.stderr, flush=True)
    sys.exit(PEER_LOST_EXIT_STATUS if code == PEER_LOST_EXIT_STATUS else FAILED_EXIT_STATUS)


def start(train: Callable[[Config, Context], None], cfg: Config) -> None:
    """Run `train(cfg, ctx)` in every training process of this node: here,
    when a launcher started this process as one worker; otherwise in one
    spawned worker per GPU (or per --nproc-per-node on the CPU)."""
    gpus_visible = torch.cuda.device_count() if cfg.device != "cpu" else 0
    plan = discover(cfg, os.environ, gpus_visible, ray_train_context())
    check_before_start(cfg, plan, gpus_visible)
    if not plan.spawns:
        _run_worker(train, cfg, plan, plan.local_rank)
        return
    if plan.node_rank == 0:
        print(f"starting {plan.procs_per_node} worker processes on this node ({plan.nodes} node(s), world size "
              f"{plan.world_size}, rendezvous {without_credentials(plan.init_method)})", flush=True)
    _spawn_and_watch(train, cfg, plan)
