"""On a CUDA GPU (skipped elsewhere): one GPU per process (issue 41 §3). Two srun tasks that
see the same GPU, as a job without --gpus-per-task gives them, stop before NCCL's first
collective with the line that names the GPU by its UUID; and that UUID is the one nvidia-smi
lists. With two GPUs or more, test_gpu.py's DDP runs pass the check. On the CPU,
tests/unit/test_gpu_binding.py gathers stand-in UUIDs."""
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from common.launcher import SLURM_PORT_BASE, SLURM_PORT_SPAN
from common.ports import free_port
from helpers import REPO, start


@pytest.mark.gpu
def test_two_srun_tasks_that_see_one_gpu_both_stop_with_the_line_naming_it(tmp_path):
    import torch

    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    uuid = str(torch.cuda.get_device_properties(0).uuid)  # this process's cuda:0 is that GPU too
    # srun -n 2 on one node, faked, each task shown the same GPU; its job id chosen so the derived port is free.
    job_id = free_port(SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN) - SLURM_PORT_BASE + 3 * SLURM_PORT_SPAN
    slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "CUDA_VISIBLE_DEVICES": first}
    command = [sys.executable, REPO / "imagenet_ddp.py", "--synthetic", "-a", "resnet18", "-b", "8", "--epochs", "1",
               "--steps-per-epoch", "2", "--logdir", tmp_path / "runs", "--dist-timeout", "120"]
    tasks = [start(command, dict(slurm, SLURM_PROCID=str(task), SLURM_LOCALID=str(task))) for task in (0, 1)]
    outputs = [task.communicate(timeout=400)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [2, 2], outputs
    errors = [line for output in outputs for line in output.splitlines() if "error:" in line]
    # Said once, by the node's local rank 0; no NCCL message, no traceback; nothing written.
    assert errors == [
        f"imagenet_ddp.py: error: ranks 0 and 1 share one GPU (UUID {uuid}, cuda:0 of each) on host "
        f"{socket.gethostname()}; every process needs a GPU of its own (NCCL would stop at its first collective: "
        f"'Duplicate GPU detected'): each of them sees only that one GPU: the job gives its tasks the same GPU; give each its own "
        f"(srun --gpus-per-task=1, or a CUDA_VISIBLE_DEVICES of its own per process)"], outputs
    assert not any(said in output for output in outputs for said in ("Traceback", "NCCL WARN", "DistBackendError")), \
        outputs
    assert not (tmp_path / "runs").exists()


@pytest.mark.gpu
def test_a_gpus_identity_is_its_uuid_as_nvidia_smi_lists_it():
    import torch

    from common.distributed import single_process
    from common.rendezvous import gpu_identity

    identity = gpu_identity(single_process("cuda"))
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", identity.uuid), identity
    assert (identity.host, identity.local_rank, identity.device_index, identity.gpus_visible) == \
        (socket.gethostname(), 0, 0, torch.cuda.device_count())
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
        # A whole GPU is listed as GPU-<uuid>, a MIG instance as MIG-<uuid>: CUDA gives the instance's own.
        assert f"GPU-{identity.uuid}" in listed or f"MIG-{identity.uuid}" in listed, (identity.uuid, listed)
