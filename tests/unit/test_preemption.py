"""The shared stop decision, periodic checkpoint timing and the Slurm requeue
(common.preemption), in one process and across two gloo processes."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import distributed, preemption, process_signals
from common.cli import parse
from common.errors import STOPPED_EXIT_STATUS, UsageError
from common.preemption import StopControl
from helpers import free_port


class Lines:
    """A stand-in for RunLog that keeps what the primary would print."""

    is_primary = True

    def __init__(self):
        self.lines = []

    def info(self, message: str) -> None:
        self.lines.append(message)


def test_one_process_stops_at_the_step_after_the_signal_and_restores_the_handlers():
    ctx = distributed.single_process("cpu")
    before = signal.getsignal(signal.SIGUSR1)
    with StopControl(ctx, "SIGUSR1", checkpoint_every_minutes=0) as control:
        decisions = []
        for step in range(6):
            decision = control.step(step)
            decisions.append(decision)
            if decision.stop:
                break
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
    assert [decision.stop for decision in decisions] == [False, False, False, True]
    assert decisions[-1].requeue and decisions[-1].checkpoint and decisions[-1].signal_name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == before


def test_sigterm_stops_without_asking_for_a_requeue():
    ctx = distributed.single_process("cpu")
    with StopControl(ctx, "SIGUSR1", checkpoint_every_minutes=0) as control:
        os.kill(os.getpid(), signal.SIGTERM)
        decision = control.step(0)
    assert decision.stop and not decision.requeue and decision.signal_name == "SIGTERM"


def test_step_checkpoints_fall_on_multiples_of_n_completed_steps():
    ctx = distributed.single_process("cpu")
    with StopControl(ctx, checkpoint_every_steps=3, checkpoint_every_minutes=0) as control:
        due = [step for step in range(10) if control.step(step).checkpoint]
    assert due == [3, 6, 9]


def test_time_checkpoints_come_once_per_interval(monkeypatch):
    ctx = distributed.single_process("cpu")
    clock = [1000.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    with StopControl(ctx, checkpoint_every_minutes=1.0) as control:
        due = []
        for step in range(12):
            clock[0] += 25.0  # a step every 25 s: 60 s have passed at steps 2, 4 (after the reset), ...
            if control.step(step).checkpoint:
                due.append(step)
    assert due == [2, 5, 8, 11]
    assert not control.now().checkpoint  # an epoch's end writes its own checkpoint


def _decide_in_two_processes(rank: int, port: int, signalled_rank: int, signal_at_step: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = distributed.Context(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), backend="gloo")
    stopped_at = None
    with StopControl(ctx, "SIGUSR1", checkpoint_every_minutes=0) as control:
        for step in range(50):
            decision = control.step(step)
            if decision.stop:
                stopped_at = step
                break
            if rank == signalled_rank and step == signal_at_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            dist.barrier()  # stands for the step's gradient all-reduce
    results[rank] = (stopped_at, decision.requeue)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_a_signal_to_one_process_stops_both_at_the_same_step(signalled_rank):
    results = mp.Manager().dict()
    mp.spawn(_decide_in_two_processes, args=(free_port(), signalled_rank, 4, results), nprocs=2)
    # Signalled before step 5's combination began: its flag is combined at step 5 and seen at step 6.
    assert dict(results) == {0: (6, True), 1: (6, True)}


def _fake_scontrol(tmp_path, exit_status: int = 0):
    calls = tmp_path / "scontrol-calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\necho "scontrol said no" >&2\nexit {exit_status}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return calls, {"PATH": f"{script.parent}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


def test_requeue_runs_scontrol_once_with_the_job_id(tmp_path):
    calls, environ = _fake_scontrol(tmp_path)
    log = Lines()
    assert preemption.requeue_slurm_job(log, environ)
    assert calls.read_text() == "requeue 4242\n"
    assert log.lines == ["requeued Slurm job 4242 (scontrol requeue 4242): it continues from the checkpoint when "
                         "it starts again"]


def test_a_failed_requeue_is_reported_not_raised(tmp_path):
    calls, environ = _fake_scontrol(tmp_path, exit_status=1)
    log = Lines()
    assert not preemption.requeue_slurm_job(log, environ)
    assert "exited with status 1 (scontrol said no); resubmit the job" in log.lines[0]
    log = Lines()
    assert not preemption.requeue_slurm_job(log, {"PATH": str(tmp_path / "empty"), "SLURM_JOB_ID": "7"})
    assert log.lines == ["could not requeue Slurm job 7: scontrol is not on PATH; resubmit the job to continue"]


def test_requeue_auto_means_under_slurm():
    assert preemption.should_requeue("auto", {"SLURM_JOB_ID": "1"})
    assert not preemption.should_requeue("auto", {})
    assert not preemption.should_requeue("never", {"SLURM_JOB_ID": "1"})
    assert preemption.should_requeue("always", {})


@pytest.mark.parametrize("text, steps, minutes", [("10min", 0, 10.0), ("0.5min", 0, 0.5), ("500steps", 500, 0.0),
                                                  ("0", 0, 0.0)])
def test_checkpoint_every_takes_minutes_or_steps(text, steps, minutes):
    cfg = parse("nd", ["--synthetic", "--checkpoint-every", text])
    assert (cfg.checkpoint_every_steps, cfg.checkpoint_every_minutes) == (steps, minutes)


@pytest.mark.parametrize("flag, value, message", [
    ("--checkpoint-every", "10", "expected minutes like 10min, steps like 500steps, or 0"),
    ("--checkpoint-every", "0steps", "expected minutes like 10min"),
    ("--preempt-signal", "USR9", "'USR9' is not one of USR1, USR2, TERM"),
    ("--preempt-signal", "HUP", "'HUP' is not one of USR1, USR2, TERM"),
])
def test_bad_checkpoint_and_signal_flags_are_one_line_errors(flag, value, message):
    with pytest.raises(UsageError, match=f"argument {flag}: .*{message}"):
        parse("nd", ["--synthetic", flag, value])


@pytest.mark.parametrize("text", ["USR2", "SIGUSR2", str(int(signal.SIGUSR2))])
def test_preempt_signal_spellings(text):
    assert parse("nd", ["--synthetic", "--preempt-signal", text]).preempt_signal == "SIGUSR2"


def test_stopped_exit_status_is_ex_tempfail():
    assert STOPPED_EXIT_STATUS == 75 == preemption.TrainingStopped("SIGUSR1").code


class _SlowIndices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 200

    def __getitem__(self, index: int):
        time.sleep(0.01)
        return torch.tensor([index, os.getpid()])


@pytest.fixture(params=["alone", "in a process group"])
def trainer_process(request):
    """The process that forks the data-loading workers: as it is, or as a
    training process is after joining (a gloo group, its share of the CPU
    threads), where a library starts a thread in each forked child."""
    if request.param == "alone":
        yield
        return
    threads = torch.get_num_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.set_num_threads(2)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def test_data_loading_workers_outlive_stop_signals_from_others_but_not_their_trainer(trainer_process):
    """Slurm signals every process of the job: the data-loading workers must
    leave the stop to the trainer (it needs them for the steps up to the
    agreed one), yet still exit when the trainer itself stops them."""
    loader = torch.utils.data.DataLoader(_SlowIndices(), batch_size=4, num_workers=2,
                                         worker_init_fn=process_signals.data_loader_worker_init,
                                         multiprocessing_context=process_signals.data_loader_context())
    batches = iter(loader)
    indices, worker_pids = [], set()
    for step, batch in enumerate(batches):
        indices.extend(batch[:, 0].tolist())
        worker_pids.update(batch[:, 1].tolist())
        if step == 3:  # sent by another process (kill), as slurmstepd would
            subprocess.run(["kill", "-TERM", *map(str, worker_pids)], check=True)
            subprocess.run(["kill", "-USR1", *map(str, worker_pids)], check=True)
    assert indices == list(range(200)) and len(worker_pids) == 2
    again = iter(loader)
    next(again)
    for worker in again._workers:  # the trainer's own SIGTERM (multiprocessing's terminate) ends them
        os.kill(worker.pid, signal.SIGTERM)
        worker.join(timeout=10)
        assert worker.exitcode == 0


def test_off_the_main_thread_no_handler_is_installed_and_periodic_checkpoints_still_come():
    # Ray Train calls the training function in a thread of its own, where signal.signal raises.
    import threading

    ctx = distributed.single_process("cpu")
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def train():
        try:
            with StopControl(ctx, "SIGUSR1", checkpoint_every_steps=2) as control:
                seen["handler"] = signal.getsignal(signal.SIGTERM)
                seen["checkpoints"] = [step for step in range(7) if control.step(step).checkpoint]
                control.ignore_signals()
        except Exception as error:  # noqa: BLE001 - the thread's failure is the test's
            seen["error"] = error

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert "error" not in seen, seen.get("error")
    assert seen["handler"] == before == signal.getsignal(signal.SIGTERM)
    assert seen["checkpoints"] == [2, 4, 6]  # every 2 completed steps, as in the main thread
