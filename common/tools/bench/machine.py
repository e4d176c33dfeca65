"""What every row records about the machine it ran on: the device's name,
the CPU threads, the versions of torch, torchvision and CUDA, the host and
the date, which half types the device runs natively (common.hardware), and
the code that ran (common.provenance: asked once per run, Settings.code).
"""
from __future__ import annotations

import datetime
import os
import platform
import socket
from pathlib import Path
from typing import Dict, Mapping


def versions() -> Dict[str, object]:
    """What every row records about the machine: device, versions, and the
    device's half-precision support (common.hardware)."""
    import torch
    import torchvision

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else (_cpu_model() or platform.processor() or "CPU")
    support = half_support("cuda" if cuda else "cpu")
    return {"device_name": name, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "cuda": torch.version.cuda if cuda else "",
            "host": socket.gethostname(), "date": datetime.date.today().isoformat(),
            "capability": support.capability + (f" ({support.capped_by})" if support.capped_by else ""),
            "bf16_native": support.bf16_native, "fp16_native": support.fp16_native}


def with_machine(row: dict, code: Mapping) -> dict:
    """`row` with the machine's fields (versions()) filled in where it has none,
    and the code's (`code`: common.provenance.code_version(), asked once per
    run; an unknown one empty); the same row."""
    row.update({key: value for key, value in versions().items() if not row.get(key)})
    row.update({key: "" if value is None else value for key, value in code.items()})
    return row


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return ""


def half_support(device: str):
    """common.hardware's answer for the harness's --device (cpu, or the first GPU)."""
    import torch

    from common import hardware

    return hardware.half_support(torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
