"""One GPU per process (common.rendezvous.check_gpu_binding, issue 41 §3): the
line that names the ranks sharing a GPU, from stand-in identities; and real
gloo processes, joined as a per-node launch joins them, that gather stand-in
GPU UUIDs: a shared one stops every process with that line and exit status 2
before training, distinct ones train, and a peer that never gathers ends the
wait within --dist-timeout. The real UUIDs: tests/e2e/test_gpu_per_process.py."""
from __future__ import annotations

import multiprocessing
import time

from common import cli, rendezvous, spawn
from common.errors import PEER_LOST_EXIT_STATUS, USAGE_EXIT_STATUS, program, run_main
from common.launcher import Launch
from common.ports import free_port
from common.rendezvous import GpuIdentity, shared_gpu_line, shared_gpus

UUID_A = "8932f937-d72c-4106-c12f-20bd9faed9f6"
UUID_B = "ffc79498-8ff3-c2dc-3b0d-fafd804516ae"
UUID_C = "41255406-c9af-f94b-4ebf-9d57ad1853da"
EACH_SEES_ONE = ("each of them sees only that one GPU: the job gives its tasks the same GPU; give each its own "
                 "(srun --gpus-per-task=1, or a CUDA_VISIBLE_DEVICES of its own per process)")
NEEDS_ITS_OWN = ("every process needs a GPU of its own (NCCL would stop at its first collective: 'Duplicate GPU "
                 "detected'): ")


def gpu(uuid: str, local_rank: int, host: str = "node7", index: int = 0, visible: int = 1) -> GpuIdentity:
    return GpuIdentity(host=host, uuid=uuid, local_rank=local_rank, device_index=index, gpus_visible=visible)


def test_srun_tasks_that_see_the_same_single_gpu_are_named_with_it_and_told_to_bind_one_each():
    identities = [gpu(UUID_A, 0), gpu(UUID_A, 1)]
    assert shared_gpus(identities) == [[0, 1]]
    assert shared_gpu_line(identities) == (
        f"ranks 0 and 1 share one GPU (UUID {UUID_A}, cuda:0 of each) on host node7; {NEEDS_ITS_OWN}{EACH_SEES_ONE}")


def test_two_nodes_commands_on_one_host_are_told_by_their_repeated_local_rank():
    # --world-size 2 --rank 0 and --rank 1, both started on node7: each node's local rank 0 takes cuda:0.
    identities = [gpu(UUID_A, 0, visible=4), gpu(UUID_A, 0, visible=4)]
    assert shared_gpu_line(identities) == (
        f"ranks 0 and 1 share one GPU (UUID {UUID_A}, cuda:0 of each) on host node7; {NEEDS_ITS_OWN}2 of them are "
        f"local rank 0 on host node7: the processes of two nodes were started on one host; start each node's command "
        f"on its own host, with its own node rank")


def test_several_shared_gpus_across_hosts_each_named_with_their_ranks_and_numbers():
    # 8 ranks on two hosts: ranks 0, 2 and 3 on one GPU of node7 (seen as different numbers), 5 and 7 on one of
    # node8; 1, 4 and 6 alone on theirs.
    identities = [gpu(UUID_A, 0, index=0, visible=3), gpu(UUID_C, 1, index=1, visible=3),
                  gpu(UUID_A, 2, index=1, visible=3), gpu(UUID_A, 3, index=2, visible=3),
                  gpu("a" * 36, 0, host="node8"), gpu(UUID_B, 1, host="node8"), gpu("b" * 36, 2, host="node8"),
                  gpu(UUID_B, 3, host="node8")]
    assert shared_gpus(identities) == [[0, 2, 3], [5, 7]]
    assert shared_gpu_line(identities) == (
        f"ranks 0, 2 and 3 share one GPU (UUID {UUID_A}, as cuda:0, cuda:1 and cuda:2) on host node7; ranks 5 and 7 "
        f"share one GPU (UUID {UUID_B}, cuda:0 of each) on host node8; {NEEDS_ITS_OWN}give each process a GPU of its "
        f"own: one process per visible GPU, each its own local rank (check CUDA_VISIBLE_DEVICES and the launcher's "
        f"process count per node)")


def test_one_gpu_under_two_host_names_is_one_gpu():
    """Containers of one machine given the same GPU: the UUID says it is one, whatever the host names."""
    line = shared_gpu_line([gpu(UUID_A, 0, host="box-a"), gpu(UUID_A, 0, host="box-b")])
    assert line.startswith(f"ranks 0 and 1 share one GPU (UUID {UUID_A}, cuda:0 of each) on hosts box-a and box-b "
                           f"(one machine's containers?); {NEEDS_ITS_OWN}each of them sees only")


def test_distinct_gpus_the_cpu_and_mig_instances_share_nothing():
    assert shared_gpu_line([gpu(UUID_A, 0), gpu(UUID_B, 1), gpu(UUID_C, 0, host="node8")]) is None
    assert shared_gpu_line([None, None, None]) is None  # CPU processes
    # Two MIG instances of one GPU: CUDA gives each its own UUID, so each process has a device of its own.
    assert shared_gpu_line([gpu(UUID_A, 0), gpu(UUID_B, 1)]) is None and shared_gpus([gpu(UUID_A, 0)]) == []


def test_thousands_of_ranks_on_few_gpus_make_one_short_line():
    identities = [gpu(f"{rank % 5:036d}", rank % 8, host=f"node{rank // 8}", index=rank % 8, visible=8)
                  for rank in range(4096)]
    assert [len(ranks) for ranks in shared_gpus(identities)] == [820, 819, 819, 819, 819]
    line = shared_gpu_line(identities)
    assert line.startswith(f"ranks 0, 5, 10, 15, 20, 25, 30, 35 and 812 more share one GPU (UUID {0:036d}, as cuda:0, "
                           f"cuda:5, cuda:2, cuda:7 and 4 more) on hosts node0, node1, node2, node3 and 508 more (one "
                           f"machine's containers?); ranks 1, 6, 11, ")
    assert line.endswith("; 2 more GPU(s) are shared likewise; " + NEEDS_ITS_OWN + "give each process a GPU of its "
                         "own: one process per visible GPU, each its own local rank (check CUDA_VISIBLE_DEVICES and "
                         "the launcher's process count per node)")
    assert line.count("share one GPU") == 3 and len(line) < 1200, len(line)


# --- real gloo processes, joined as imagenet_ddp.py's per-node launch joins them ---

def _stand_in_identity(uuids, notes):
    """gpu_identity's stand-in: local rank r computes on the GPU uuids[r], seen alone as its cuda:0; each call
    noted in the folder `notes`."""
    def identify(ctx):
        (notes / f"identified-rank{ctx.rank}").write_text(uuids[ctx.local_rank])
        return gpu(uuids[ctx.local_rank], ctx.local_rank)

    return identify


def _worker(local_rank, cfg, launch, notes):
    def train(cfg, ctx):
        (notes / f"trained-rank{ctx.rank}").write_text("trained")

    run_main(lambda: spawn._run_worker(train, cfg, launch, local_rank), launch.rank_of(local_rank), local_rank)


def _run_node(tmp_path, monkeypatch, uuids, dist_timeout=60, hang_rank=None):
    """The workers of one node of len(uuids) processes, forked from this one with gpu_identity stood in for
    (forked, they keep the stand-in; under torchrun or srun the same _run_worker runs). Returns the workers, and
    the folder where each notes what it did (identified-rankN, trained-rankN)."""
    cfg = cli.parse("ddp", ["--synthetic", "--device", "cpu", "--dist-timeout", str(dist_timeout)])
    # The plan discover makes of --dist-url tcp://127.0.0.1:PORT --world-size 1 --rank 0 --nproc-per-node N (made
    # here: discover refuses more CPU processes than this machine has cores, and CI's has 2).
    launch = Launch(launcher="spawn", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=len(uuids), nodes=1,
                    node_rank=0, procs_per_node=len(uuids))
    notes = tmp_path / "notes"
    notes.mkdir()
    identify = _stand_in_identity(uuids, notes)
    if hang_rank is not None:
        def identify(ctx, answer=identify):  # this rank never reaches the gather: a process stuck before it
            if ctx.rank == hang_rank:
                time.sleep(600)
            return answer(ctx)
    monkeypatch.setattr(rendezvous, "gpu_identity", identify)
    fork = multiprocessing.get_context("fork")
    workers = [fork.Process(target=_worker, args=(local_rank, cfg, launch, notes), name=f"rank{local_rank}")
               for local_rank in range(len(uuids))]
    for worker in workers:
        worker.start()
    return workers, notes


def _finish(workers, seconds=300):
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    codes = [worker.exitcode for worker in workers]
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    return codes


def test_three_processes_two_of_them_on_one_gpu_all_stop_with_the_line_before_training(tmp_path, monkeypatch, capfd):
    workers, notes = _run_node(tmp_path, monkeypatch, [UUID_A, UUID_B, UUID_A])
    assert _finish(workers) == [USAGE_EXIT_STATUS] * 3
    # Each told the others its GPU; none reached training.
    assert sorted(path.name for path in notes.iterdir()) == ["identified-rank0", "identified-rank1", "identified-rank2"]
    # The same UsageError in every process, said once per node (by local rank 0), without a traceback.
    err = capfd.readouterr().err
    assert err.splitlines() == [f"{program()}: error: ranks 0 and 2 share one GPU (UUID {UUID_A}, cuda:0 of each) on "
                                f"host node7; {NEEDS_ITS_OWN}{EACH_SEES_ONE}"], err


def test_processes_on_gpus_of_their_own_train(tmp_path, monkeypatch, capfd):
    workers, notes = _run_node(tmp_path, monkeypatch, [UUID_A, UUID_B])
    assert _finish(workers) == [0, 0]
    assert sorted(path.name for path in notes.iterdir()) == ["identified-rank0", "identified-rank1", "trained-rank0",
                                                             "trained-rank1"]
    assert "error" not in capfd.readouterr().err


def test_a_peer_that_never_gathers_ends_the_wait_within_dist_timeout(tmp_path, monkeypatch, capfd):
    workers, notes = _run_node(tmp_path, monkeypatch, [UUID_A, UUID_B], dist_timeout=2, hang_rank=1)
    started = time.monotonic()
    codes = _finish(workers[:1], seconds=240)  # rank 0 alone: rank 1 is killed after
    waited = time.monotonic() - started
    _finish(workers[1:], seconds=0)
    assert codes == [PEER_LOST_EXIT_STATUS] and waited < 240
    lines = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(f"{program()}: error: rank 0: lost rank 1: no answer within "
                                                   f"--dist-timeout 2 s ("), lines
    assert "(the process group joined)" in lines[0]
    assert sorted(path.name for path in notes.iterdir()) == ["identified-rank0"]  # rank 1 hangs before its note
