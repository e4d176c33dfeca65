"""Rank and world discovery (common.launcher.discover) for every launcher,
from faked environments: pure functions, no processes."""
import dataclasses
import re

import pytest

from common import cli
from common.errors import USAGE_EXIT_STATUS, UsageError, exit_status
from common.launcher import discover, first_slurm_host, gpu_of_its_own, launched_identity, slurm_port


def ddp_config(*flags):
    return cli.parse("ddp", ["--synthetic", *flags])


@pytest.mark.parametrize("nodelist, first", [
    ("gpu07", "gpu07"),
    ("gpu[07-09,12],cpu01", "gpu07"),
    ("gpu[12,07-09]", "gpu12"),  # Slurm keeps the order it was given
    ("node[001-004]", "node001"),  # zero padding kept
    ("a1,b[1-2]", "a1"),
    ("node[1-2]-ib", "node1-ib"),
    ("rack[3-4]-n[10-11]", "rack3-n10"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm_port_is_a_function_of_the_job_id_below_the_ephemeral_range():
    assert slurm_port(4242) == 14242 and slurm_port(20000 + 4242) == 14242
    assert {slurm_port(job) for job in range(0, 10**7, 997)} <= set(range(10000, 30000))


def test_torchrun_workers_meet_in_a_namespace_of_their_attempt_in_the_agents_store():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7",
           "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    launch = discover(ddp_config(), env, gpus_visible=0)
    assert (launch.restart_attempt, launch.agent_store, launch.init_method) == (1, ("10.0.0.7", 29400), "env://")
    without_agent_store = discover(ddp_config(), dict(env, TORCHELASTIC_USE_AGENT_STORE="False"), gpus_visible=0)
    assert (without_agent_store.restart_attempt, without_agent_store.agent_store) == (None, None)


def test_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    launch = discover(ddp_config(), env, gpus_visible=4)
    assert (launch.launcher, launch.init_method, launch.rank, launch.local_rank, launch.world_size) == \
        ("torchrun", "env://", 5, 1, 8)
    assert (launch.nodes, launch.node_rank, launch.procs_per_node, launch.spawns) == (2, 1, 4, False)


@pytest.mark.parametrize("spelling", ["--local-rank=3", "--local_rank=3"])
def test_torch_distributed_launch_passes_local_rank_as_a_flag(spelling):
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "8888"}  # no LOCAL_RANK
    launch = discover(ddp_config(spelling), env, gpus_visible=4)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size) == \
        ("torch.distributed.launch", 3, 3, 4)


def test_per_node_flags_under_torchrun_are_refused():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    with pytest.raises(UsageError, match="argument --world-size: the launcher already set RANK"):
        discover(ddp_config("--world-size", "2", "--rank", "0", "--dist-url", "tcp://h:1"), env, gpus_visible=0)
    with pytest.raises(UsageError, match="argument --nproc-per-node"):
        discover(ddp_config("--nproc-per-node", "2"), env, gpus_visible=0)
    with pytest.raises(UsageError, match="argument --dist-url: the launcher already set"):
        discover(ddp_config("--dist-url", "tcp://h:1"), env, gpus_visible=0)


def test_launched_identity_for_reporting_errors_before_the_group_exists():
    assert launched_identity({}) == (None, None)
    assert launched_identity({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}) == (5, 1)
    assert launched_identity(SLURM_TWO_NODES_FOUR_TASKS_EACH) == (6, 2)
    assert launched_identity({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) == (None, None)  # a batch shell


SLURM_TWO_NODES_FOUR_TASKS_EACH = {
    "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456",
}


def test_slurm_one_task_per_gpu():
    launch = discover(ddp_config(), SLURM_TWO_NODES_FOUR_TASKS_EACH, gpus_visible=4)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size) == ("slurm", 6, 2, 8)
    assert (launch.nodes, launch.node_rank, launch.procs_per_node) == (2, 1, 4)
    assert launch.init_method == f"tcp://gpu07:{slurm_port(123456)}"


def test_slurm_step_nodelist_wins_over_the_job_nodelist_and_dist_url_over_both():
    env = dict(SLURM_TWO_NODES_FOUR_TASKS_EACH, SLURM_STEP_NODELIST="gpu[08,07]")
    assert discover(ddp_config(), env, gpus_visible=4).init_method.startswith("tcp://gpu08:")
    chosen = discover(ddp_config("--dist-url", "tcp://gpu07:23456"), env, gpus_visible=4)
    assert (chosen.launcher, chosen.init_method, chosen.rank, chosen.world_size) == \
        ("slurm", "tcp://gpu07:23456", 6, 8)
    # Explicit per-node flags mean the per-node style, even inside srun: this process spawns.
    launch = discover(ddp_config("--dist-url", "tcp://gpu07:23456", "--world-size", "2", "--rank", "1"), env,
                      gpus_visible=4)
    assert launch.spawns and (launch.world_size, launch.node_rank, launch.rank_of(3)) == (8, 1, 7)


def test_slurm_one_task_per_node_spawns_a_worker_per_gpu():
    env = dict(SLURM_TWO_NODES_FOUR_TASKS_EACH, SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="2")
    launch = discover(ddp_config(), env, gpus_visible=4)
    assert launch.spawns and launch.launcher == "slurm"
    assert (launch.world_size, launch.nodes, launch.node_rank, launch.procs_per_node) == (8, 2, 1, 4)
    assert [launch.rank_of(local) for local in range(4)] == [4, 5, 6, 7]


def test_an_sbatch_shell_without_srun_is_not_a_slurm_launch():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1"}
    launch = discover(ddp_config(), env, gpus_visible=4)
    assert launch.spawns and launch.launcher == "spawn" and launch.world_size == 4


def test_plain_python_spawns_one_worker_per_visible_gpu_on_a_free_local_port():
    launch = discover(ddp_config(), {}, gpus_visible=3)
    assert launch.spawns and (launch.world_size, launch.nodes, launch.procs_per_node) == (3, 1, 3)
    assert launch.init_method.startswith("tcp://127.0.0.1:")
    cpu = discover(ddp_config(), {}, gpus_visible=0)
    assert (cpu.world_size, cpu.procs_per_node) == (1, 1)
    assert discover(ddp_config("--nproc-per-node", "3"), {}, gpus_visible=0).world_size == 3


def test_per_node_style_counts_nodes_and_ranks_nodes():
    launch = discover(ddp_config("--dist-url", "tcp://10.0.0.1:23456", "--world-size", "4", "--rank", "2"), {},
                      gpus_visible=8)
    assert (launch.init_method, launch.world_size, launch.node_rank) == ("tcp://10.0.0.1:23456", 32, 2)
    assert [launch.rank_of(local) for local in (0, 7)] == [16, 23]


@pytest.mark.parametrize("flags, gpus, message", [
    (["--world-size", "2", "--dist-url", "tcp://h:1"], 1, "argument --rank: needed with --world-size 2"),
    (["--world-size", "2", "--rank", "1"], 1, "argument --dist-url: needed with --world-size 2"),
    (["--nproc-per-node", "4"], 2, "argument --nproc-per-node: 4 processes but 2 GPUs"),
    (["--world-size", "1", "--rank", "0", "--dist-url", "tcp://h"], 0, "argument --dist-url: expected tcp://HOST:PORT"),
])
def test_inconsistent_per_node_flags(flags, gpus, message):
    with pytest.raises(UsageError, match=message):
        discover(ddp_config(*flags), {}, gpus_visible=gpus)


def test_launch_is_picklable_for_spawned_workers():
    import pickle

    launch = discover(ddp_config("--nproc-per-node", "2"), {}, gpus_visible=0)
    assert pickle.loads(pickle.dumps(launch)) == launch
    assert dataclasses.replace(launch, node_rank=1).rank_of(1) == 3


class _EndedWorker:
    """A worker that has exited but is reaped only between two reads of its exit code (a race the
    supervisor meets under load): the first read gives None, later ones `code`."""

    def __init__(self, name: str, code: int):
        import os

        self.name, self._codes = name, iter([None])
        self._code = code
        read_end, write_end = os.pipe()
        os.close(write_end)  # end of file: the sentinel is ready, as a dead process's is
        self.sentinel = read_end

    @property
    def exitcode(self):
        return next(self._codes, self._code)


@pytest.mark.parametrize("code, status", [(2, 2), (1, 1), (-9, 1)])
def test_a_failed_worker_reaped_between_two_reads_still_fails_the_job(code, status, capsys):
    from common import spawn

    with pytest.raises(SystemExit) as stopped:
        spawn._watch([_EndedWorker("rank1", code)])
    assert stopped.value.code == status
    if code != 2:  # status 2: the worker printed its own error line
        assert "error: worker rank1" in capsys.readouterr().err


def test_of_workers_ending_together_the_one_killed_by_a_signal_is_named(capsys):
    from common import spawn

    with pytest.raises(SystemExit):
        spawn._watch([_EndedWorker("rank0", 1), _EndedWorker("rank1", -9)])
    assert "worker rank1 was killed by SIGKILL" in capsys.readouterr().err


def test_the_worker_named_for_a_failure_is_the_cause_not_a_peer_that_lost_it():
    from common.errors import PEER_LOST_EXIT_STATUS
    from common.spawn import _first_cause

    lost, usage, killed = "rank0 lost rank1", "rank1 met a bad image", "rank2 killed"
    assert _first_cause([(lost, PEER_LOST_EXIT_STATUS), (usage, 2)]) == usage
    assert _first_cause([(usage, 2), (lost, PEER_LOST_EXIT_STATUS), (killed, -9)]) == killed
    assert _first_cause([(lost, PEER_LOST_EXIT_STATUS)]) == lost  # the cause is on another node


@pytest.mark.parametrize("codes, status, line", [
    ((5, 4), 5, None),  # a batch that did not come (--data-timeout): the worker said it; its peer only lost it
    ((4,), 4, "error: worker rank0 lost its connection to another process (one on another node failed or was "
              "stopped?); stopped the other workers of this node"),
])
def test_the_launcher_keeps_a_data_timeout_and_a_lost_peer_as_their_own_statuses(codes, status, line, capsys):
    from common import spawn

    with pytest.raises(SystemExit) as stopped:
        spawn._watch([_EndedWorker(f"rank{rank}", code) for rank, code in enumerate(codes)])
    assert stopped.value.code == status
    errors = capsys.readouterr().err.splitlines()
    assert errors == ([] if line is None else [f"{spawn.program()}: {line}"])


def _exit_losing_a_peer():
    import sys

    from common.errors import PEER_LOST_EXIT_STATUS

    sys.exit(PEER_LOST_EXIT_STATUS)


def _stop_itself():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGSTOP)


def _watch_beside_a_peer_that_gave_up(silent, peer_name: str) -> int:
    """spawn._watch over `silent` (started, never exiting by itself) and a forked peer that exits as one that
    lost a peer; `silent` killed afterwards whatever happened. Returns the spawner's exit status."""
    import multiprocessing

    from common import spawn

    peer = multiprocessing.get_context("fork").Process(target=_exit_losing_a_peer, name=peer_name)
    peer.start()
    try:
        with pytest.raises(SystemExit) as ended:
            spawn._watch(sorted([silent, peer], key=lambda process: process.name), roll_call_seconds=0.0,
                         dist_timeout=7.0)
    finally:
        silent.kill()
        silent.join()
    return ended.value.code


def test_the_launcher_names_the_worker_that_stopped_answering_not_the_peer_that_gave_up_on_it(monkeypatch, capsys):
    import multiprocessing
    import time

    from common import spawn
    from common.process_signals import is_stopped

    monkeypatch.setattr(spawn, "WORKER_STOP_GRACE_SECONDS", 0.2)  # the stopped one never exits: no need to wait
    fork = multiprocessing.get_context("fork")
    stopped = fork.Process(target=_stop_itself, name="rank1")
    stopped.start()
    deadline = time.monotonic() + 60
    while not is_stopped(stopped.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _watch_beside_a_peer_that_gave_up(stopped, "rank0") == 4 and stopped.exitcode == -9  # killed: peers gone
    assert capsys.readouterr().err.splitlines() == [
        f"{spawn.program()}: error: worker rank1 stopped answering (its state: stopped by a signal, SIGSTOP or "
        f"SIGTSTP?): its peers gave up on it after --dist-timeout 7 s; killed it and stopped the other workers of "
        f"this node"]


def _data_loading_worker_waiting_for_ever(ready):
    from common.process_signals import die_with_parent

    die_with_parent()
    ready.set()
    _a_batch_that_never_comes()


def _a_batch_that_never_comes():
    import time

    time.sleep(600)


def _worker_waiting_in_a_collective(ready, child_ready):
    import multiprocessing

    from common.process_signals import dump_stacks_on_quit

    dump_stacks_on_quit()  # as spawn._spawned_worker does; the forked child inherits it
    multiprocessing.get_context("fork").Process(target=_data_loading_worker_waiting_for_ever,
                                                args=(child_ready,)).start()
    ready.set()
    _a_collective_nobody_joins()


def _a_collective_nobody_joins():
    import time

    time.sleep(600)


def test_the_launcher_writes_the_stacks_of_a_worker_that_stopped_answering_and_its_data_workers_then_kills_them(
        monkeypatch, capfd):
    import multiprocessing
    import time

    from common import spawn
    from common.process_signals import children_of, stuck_state

    monkeypatch.setattr(spawn, "WORKER_STOP_GRACE_SECONDS", 0.2)
    monkeypatch.setattr(spawn, "STACK_DUMP_SECONDS", 6.0)  # a loaded machine may take a while to run the handlers
    fork = multiprocessing.get_context("fork")
    ready, child_ready = fork.Event(), fork.Event()
    silent = fork.Process(target=_worker_waiting_in_a_collective, args=(ready, child_ready), name="rank0")
    silent.start()
    assert ready.wait(120) and child_ready.wait(120)
    children = children_of(silent.pid)
    assert len(children) == 1
    assert _watch_beside_a_peer_that_gave_up(silent, "rank1") == 4 and silent.exitcode == -9
    err = capfd.readouterr().err
    lines = err.splitlines()
    assert lines[0] == (f"{spawn.program()}: error: worker rank0 stopped answering: its peers gave up on it after "
                        f"--dist-timeout 7 s; killed it and stopped the other workers of this node")
    assert lines[1] == (f"{spawn.program()}: the stacks of worker rank0 (pid {silent.pid}) and of its data-loading "
                        f"workers follow, where each thread waited:")
    # faulthandler's dumps: the worker in its collective, its data-loading worker in its read.
    assert "_a_collective_nobody_joins" in err and "_a_batch_that_never_comes" in err
    deadline = time.monotonic() + 60
    while stuck_state(children[0]) is None and time.monotonic() < deadline:  # it dies with its parent
        time.sleep(0.05)
    assert stuck_state(children[0]) == "exited"


def test_a_roll_call_names_the_ranks_that_do_not_answer_and_none_when_the_store_does_not():
    import datetime

    import torch.distributed as dist

    from common.rendezvous import roll_call

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    # Ranks 2 and 0 timed out, in that order; rank 1 stopped. Each names the ranks not in by the end of its call.
    assert roll_call(2, 3, 0.1, store=store) == [0, 1]
    assert roll_call(0, 3, 0.1, store=store) == [1]
    assert roll_call(1, 3, 600, store=store) == []  # the last to answer: at once, all are in

    class Unanswered:
        def set_timeout(self, timeout):
            pass

        def set(self, key, value):
            raise dist.DistStoreError("Socket Timeout")

    assert roll_call(1, 3, 0.1, store=Unanswered()) is None


@pytest.mark.parametrize("silent, whom", [([1, 3], "ranks 1, 3"), ([0], "rank 0"),
                                           (None, "rank 0, whose rendezvous store does not answer either")])
def test_of_more_than_two_a_process_names_the_ranks_its_roll_call_did_not_hear(silent, whom, monkeypatch):
    import re

    import torch

    from common import spawn
    from common.distributed import Context

    cfg = ddp_config("--dist-timeout", "20", "--nproc-per-node", "4")
    launch = discover(cfg, {}, gpus_visible=0)
    asked = []
    monkeypatch.setattr(spawn, "roll_call", lambda rank, world_size, seconds: asked.append((rank, world_size, seconds))
                        or silent)
    ctx = Context(rank=2, local_rank=2, world_size=4, device=torch.device("cpu"))
    ctx.contact.heard("epoch 3 step 120/5004 done")
    error = RuntimeError("[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation "
                         "to complete")
    line = spawn._peer_loss_line(error, True, cfg, launch, ctx)
    assert asked == [(2, 4, 10.0)]  # the roll call: 10 s, or --dist-timeout if shorter
    assert re.fullmatch(rf"lost {re.escape(whom)}: no answer within --dist-timeout 20 s \(Timed out waiting 20000ms "
                        rf"for recv operation to complete\); last heard from it at \d\d:\d\d:\d\d \(epoch 3 step "
                        rf"120/5004 done\); it stopped or hangs: its output, or its node's, may say why", line), line


@pytest.mark.parametrize("message, timed_out, lost", [
    ("[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete", True,
     False),
    # A collective DDP started during backward, whose time ran out: gloo closes the pair (seen in CI).
    ("Application timeout caused pair closure", True, False),
    ("[/src/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:30001", False, True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False, False),
])
def test_what_gloo_raises_when_a_peer_is_gone_or_silent_is_told_apart_from_other_errors(message, timed_out, lost):
    from common import spawn

    assert (spawn._peer_timed_out(RuntimeError(message)), spawn._lost_a_peer(RuntimeError(message))) == \
        (timed_out, lost)
    assert not spawn._peer_timed_out(ValueError(message))  # only what a collective raises


def test_each_process_needs_a_gpu_of_its_own_which_slurm_may_bind_as_device_0():
    assert gpu_of_its_own("torchrun", gpus_visible=4, local_rank=3)
    assert not gpu_of_its_own("torchrun", gpus_visible=4, local_rank=4)  # two would share one
    assert not gpu_of_its_own("spawn", gpus_visible=1, local_rank=1)
    assert gpu_of_its_own("slurm", gpus_visible=1, local_rank=7)  # srun --gpus-per-task=1
    assert not gpu_of_its_own("slurm", gpus_visible=2, local_rank=2)
    assert gpu_of_its_own("spawn", gpus_visible=0, local_rank=5)  # the CPU


class FakeRayTrainContext:
    """What common.launcher reads of Ray Train's context (ray.train.get_context()) in a worker."""

    def __init__(self, rank, local_rank, world_size, local_world_size, node_rank, name="imagenet-Nov26-1"):
        self.values = (rank, local_rank, world_size, local_world_size, node_rank, name)

    def get_world_rank(self): return self.values[0]
    def get_local_rank(self): return self.values[1]
    def get_world_size(self): return self.values[2]
    def get_local_world_size(self): return self.values[3]
    def get_node_rank(self): return self.values[4]
    def get_experiment_name(self): return self.values[5]


def test_ray_train_gives_the_ranks_and_its_group_is_adopted_not_joined():
    # Ray also sets RANK, WORLD_SIZE and MASTER_ADDR: its context, not torchrun's reading, decides.
    env = {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}
    launch = discover(ddp_config(), env, gpus_visible=0, ray_context=FakeRayTrainContext(5, 1, 6, 4, 1))
    assert (launch.launcher, launch.init_method, launch.rank, launch.local_rank, launch.world_size) == \
        ("ray", "ray", 5, 1, 6)
    assert (launch.nodes, launch.node_rank, launch.procs_per_node, launch.spawns) == (2, 1, 4, False)


@pytest.mark.parametrize("flags", [("--nproc-per-node", "2"), ("--world-size", "2", "--rank", "0"),
                                   ("--dist-url", "tcp://h:1"), ("--local-rank", "0")])
def test_flags_that_start_processes_are_refused_under_ray(flags):
    with pytest.raises(UsageError, match=f"argument {flags[0]}: Ray Train starts the processes"):
        discover(ddp_config(*flags), {}, gpus_visible=0, ray_context=FakeRayTrainContext(0, 0, 2, 2, 0))


def test_a_ray_train_run_restarts_in_the_run_directory_of_its_name():
    from common.launcher import restart_name

    slurm = {"SLURM_JOB_ID": "77"}  # Ray on a Slurm allocation: Ray's run is the job that restarts
    assert restart_name(slurm, FakeRayTrainContext(0, 0, 2, 2, 0, "imagenet-Nov26_03-00-01-42")) == \
        "ray-imagenet-Nov26_03-00-01-42"
    assert restart_name(slurm) == "slurm-77"


def test_the_ray_head_is_the_flag_then_ray_address_then_a_new_cluster():
    from common.launcher import ray_head_address

    assert ray_head_address("h:6379", {"RAY_ADDRESS": "other:1"}) == "h:6379"
    assert ray_head_address(None, {"RAY_ADDRESS": "other:1"}) == "other:1"
    assert ray_head_address(None, {"RAY_ADDRESS": ""}) is None and ray_head_address(None, {}) is None


TORCHRUN_TWO_NODES = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                      "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
TORCHRUN_LAUNCH = (r"a launcher \(torchrun, torch.distributed.launch\) sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                   r"and LOCAL_RANK together")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "3"}, rf"environment: RANK='3' set but WORLD_SIZE not: {TORCHRUN_LAUNCH}; unset RANK to start the "
                    rf"processes here, or start the script with torchrun$"),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     rf"environment: LOCAL_RANK='1', LOCAL_WORLD_SIZE='2' set but RANK and WORLD_SIZE not: {TORCHRUN_LAUNCH}; "
     rf"unset LOCAL_RANK, LOCAL_WORLD_SIZE "),
    # Inside a Slurm allocation too: a plain python there spawns, so a stray LOCAL_RANK is as much a mistake.
    ({"LOCAL_RANK": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"},
     r"environment: LOCAL_RANK='0' set but RANK and WORLD_SIZE not: "),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
     rf"environment: RANK and WORLD_SIZE set but MASTER_ADDR, MASTER_PORT not: {TORCHRUN_LAUNCH}$"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "1"},
     r"environment: RANK and WORLD_SIZE set but LOCAL_RANK \(or --local-rank\) not: "),
    (dict(TORCHRUN_TWO_NODES, RANK="8"),
     r"environment variable RANK=8 is outside 0 to 7, the ranks of the 8 process\(es\) WORLD_SIZE says$"),
    (dict(TORCHRUN_TWO_NODES, LOCAL_RANK="4"),
     r"environment variable LOCAL_RANK=4 is outside 0 to 3, the ranks of the 4 process\(es\) LOCAL_WORLD_SIZE says$"),
    (dict(TORCHRUN_TWO_NODES, LOCAL_RANK="-1"), r"environment variable LOCAL_RANK=-1 is outside 0 to 3"),
    (dict(TORCHRUN_TWO_NODES, WORLD_SIZE="0", RANK="0"),
     r"environment variable WORLD_SIZE=0 is not a number of processes$"),
    (dict(SLURM_TWO_NODES_FOUR_TASKS_EACH, SLURM_PROCID="8"),
     r"environment variable SLURM_PROCID=8 is outside 0 to 7, the ranks of the 8 process\(es\) SLURM_STEP_NUM_TASKS "),
    ({name: value for name, value in SLURM_TWO_NODES_FOUR_TASKS_EACH.items() if name != "SLURM_LOCALID"},
     r"environment: srun set SLURM_PROCID and SLURM_STEP_NUM_TASKS but not SLURM_LOCALID \(this task's rank on its "
     r"node\), which srun sets with them$"),
])
def test_half_set_or_incoherent_launcher_variables_are_one_line_naming_them(env, message):
    with pytest.raises(UsageError, match="^" + message):
        discover(ddp_config(), env, gpus_visible=4)


def test_torch_distributed_launchs_local_rank_flag_must_be_one_of_its_processes():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "8888"}
    with pytest.raises(UsageError, match=r"^argument --local-rank: 4 is outside 0 to 3, the ranks of the 4 "
                                         r"process\(es\) WORLD_SIZE says$"):
        discover(ddp_config("--local-rank=4"), env, gpus_visible=4)


def test_world_size_alone_is_refused_unless_it_says_the_one_process_that_runs():
    launch = discover(ddp_config(), {"WORLD_SIZE": "1"}, gpus_visible=0)
    assert launch.spawns and (launch.launcher, launch.world_size) == ("spawn", 1)
    with pytest.raises(UsageError, match=rf"^environment: WORLD_SIZE='4' set but RANK not: {TORCHRUN_LAUNCH}; "
                                         rf"unset WORLD_SIZE to start the processes here, or start the script with "
                                         rf"torchrun$"):
        discover(ddp_config(), {"WORLD_SIZE": "4"}, gpus_visible=0)


def test_a_rank_outside_its_world_is_said_by_the_process_that_has_it(capsys):
    env = dict(TORCHRUN_TWO_NODES, LOCAL_RANK="4")  # not local rank 0: such a process leaves same errors to it
    with pytest.raises(UsageError) as caught:
        discover(ddp_config(), env, gpus_visible=4)
    assert exit_status(caught.value, *launched_identity(env)) == USAGE_EXIT_STATUS
    assert re.fullmatch(r".*: error: rank 5: environment variable LOCAL_RANK=4 is outside 0 to 3, the ranks of the 4 "
                        r"process\(es\) LOCAL_WORLD_SIZE says\n", capsys.readouterr().err)


# --- what a node can run: process counts against its cores and memory ---

GIB = 2 ** 30


def test_more_training_processes_than_cores_on_the_cpu_are_refused_in_one_line():
    from common.launcher import check_node_processes

    with pytest.raises(UsageError, match=r"^argument --nproc-per-node: 3 training processes on the CPU, but this "
                                         r"node gives the job 2 core\(s\); at most one process per core"):
        check_node_processes(3, 0, 4, 32, share_cores=True, cores=2, memory=GIB)
    check_node_processes(2, 0, 4, 32, share_cores=True, cores=2, memory=GIB)  # one each
    check_node_processes(3, 0, 4, 32, share_cores=False, cores=2, memory=GIB)  # GPUs, or srun's own cores


@pytest.mark.parametrize("workers", [10**6, 10**15])
def test_more_data_loading_processes_than_memory_holds_are_refused_at_once(workers):
    from common.launcher import check_node_processes

    # 8 MiB of its own and two prefetched batches of 4 x 3 x 32 x 32 bytes each: 10**6 of them need 8.4 TB.
    with pytest.raises(UsageError, match=rf"^argument -j/--workers: -j {workers} data-loading processes x "
                                         rf"--nproc-per-node 2 on this node, with batches of -b 4 at --image-size 32 "
                                         rf"would take [\d.]+ TB, more than the 24.0 GB of memory this machine gives "
                                         rf"the job$"):
        check_node_processes(2, workers, 4, 32, share_cores=True, cores=2, memory=24 * 10**9)
    check_node_processes(2, 20, 4, 32, share_cores=True, cores=2, memory=24 * 10**9)  # legal, if oversubscribed


def test_processes_a_spawning_launcher_or_torchrun_starts_count_against_the_cores_srun_tasks_do_not(monkeypatch):
    from common import launcher

    monkeypatch.setattr(launcher, "usable_cores", lambda: 2)
    torchrun = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    for launch in (discover(ddp_config("--nproc-per-node", "3"), {}, gpus_visible=0),
                   discover(ddp_config(), torchrun, gpus_visible=0)):
        with pytest.raises(UsageError, match="argument --nproc-per-node: 3 training processes on the CPU"):
            launcher.check_before_start(ddp_config("-j", "0"), launch, gpus_visible=0)
    # srun may bind each task to a core of its own: what this process sees is its own, not the node's.
    srun = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "5"}
    launcher.check_before_start(ddp_config("-j", "0"), discover(ddp_config(), srun, gpus_visible=0), gpus_visible=0)


@pytest.mark.parametrize("procs, workers, line", [
    (1, 4, "warning: -j 4 = 4 data-loading processes on this node's 2 core(s): oversubscribed, they take turns; "
           "-j 2 or fewer runs as fast"),
    (2, 2, "warning: -j 2 x 2 training processes = 4 data-loading processes on this node's 2 core(s): "
           "oversubscribed, they take turns; -j 1 or fewer runs as fast"),
])
def test_a_legal_but_oversubscribed_node_is_one_warning_line(procs, workers, line):
    from common.launcher import oversubscription

    assert oversubscription(procs, workers, cores=2) == line
    assert oversubscription(1, 2, cores=2) is None and oversubscription(2, 1, cores=2) is None  # one each at most


def test_cpu_threads_are_a_share_of_the_cores_this_job_may_use_not_of_the_machine(monkeypatch):
    import os

    from common.launcher import cpu_threads_per_process

    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 9, 10, 11})  # this job's share (Slurm, taskset)
    assert cpu_threads_per_process(2, {}) == 2
    assert cpu_threads_per_process(8, {}) == 1


@pytest.mark.parametrize("url", ["tcp://alice:s3cret@node0:29500", "tcp://s3cret@node0:29500",
                                 "tcp://[alice:s3cret@node0]:29500"])
def test_a_dist_url_with_credentials_is_refused_without_quoting_them(url):
    from common.launcher import tcp_address

    with pytest.raises(UsageError, match=r"^argument --dist-url: 'tcp://(\[)?\*\*\*@node0\]?:29500' holds credentials "
                                         r"\(a user name or password before @\), which the rendezvous never takes"
                       ) as refused:
        tcp_address(url)
    assert "s3cret" not in str(refused.value) and "alice" not in str(refused.value)


def test_a_worker_ended_by_the_stop_signal_passed_on_while_starting_is_an_interruption_not_a_failure(capsys):
    import signal

    from common import spawn

    with pytest.raises(KeyboardInterrupt):  # "interrupted", exit status 130 (errors.exit_status)
        spawn._watch([_EndedWorker("rank0", -signal.SIGTERM), _EndedWorker("rank1", 130)], [signal.SIGTERM])
    assert "error" not in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a SIGTERM nobody passed on: a failure, named
        spawn._watch([_EndedWorker("rank0", -signal.SIGTERM)], [])
    assert "worker rank0 was killed by SIGTERM" in capsys.readouterr().err
