"""Rank and world discovery (common.launcher.discover) for every launcher,
from faked environments: pure functions, no processes."""
import dataclasses

import pytest

from common import cli
from common.errors import UsageError
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
    peer = fork.Process(target=_exit_losing_a_peer, name="rank0")
    peer.start()
    try:
        with pytest.raises(SystemExit) as ended:
            spawn._watch([peer, stopped], 0.0, 7.0)
    finally:
        stopped.kill()
        stopped.join()
    assert ended.value.code == 4 and stopped.exitcode == -9  # killed: its peers are gone
    assert capsys.readouterr().err.splitlines() == [
        f"{spawn.program()}: error: worker rank1 stopped answering (its state: stopped by a signal, SIGSTOP or "
        f"SIGTSTP?): its peers gave up on it after --dist-timeout 7 s; killed it and stopped the other workers of "
        f"this node"]


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
