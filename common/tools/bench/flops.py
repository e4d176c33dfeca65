"""Model FLOPs utilisation's arithmetic: the FLOPs of one training image
(torch.utils.flop_counter), the dense peaks of NVIDIA's GPUs by precision,
and MFU, the model's FLOP/s over that peak. torch is imported only to count.
"""
from __future__ import annotations

import functools
import re
from typing import Optional

# Dense peaks (no 2:4 sparsity) in TFLOP/s, by the precision a row trains in, from NVIDIA's datasheets,
# whose tensor-core figures are quoted with sparsity (twice these): H100 Tensor Core GPU datasheet
# (SXM5: TF32 989, BF16/FP16 1,979; PCIe: TF32 756, BF16/FP16 1,513; the dense SXM5 figures 494.7
# and 989.4 in the "NVIDIA H100 Tensor Core GPU Architecture" whitepaper), H200 datasheet (SXM: the
# H100 SXM5's), A100 datasheet (TF32 156, BF16/FP16 312, dense), V100 datasheet (no TF32, no bf16:
# fp32 15.7 SXM2, 14 PCIe, 16.4 V100S; fp16 tensor 125, 112, 130). "fp32" is what an fp32 row runs
# at: TF32 tensor cores from Ampere on (cuDNN's convolutions use TF32 by default, and the scripts
# allow it for matrix products: docs/speed.md), the plain fp32 rate on Volta. Matched against the
# device name in order; H100 NVL and H200 NVL (lower clocks) are left out, not yet confirmed.
GPU_PEAK_TFLOPS = (
    (r"H100 PCIe", {"fp16": 756.5, "bf16": 756.5, "fp32": 378.0}),
    (r"H100 (80GB HBM3|SXM)|H200(?! NVL)", {"fp16": 989.4, "bf16": 989.4, "fp32": 494.7}),
    (r"A100", {"fp16": 312.0, "bf16": 312.0, "fp32": 156.0}),
    (r"V100S", {"fp16": 130.0, "fp32": 16.4}),
    (r"V100.*PCIE", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
)


def gpu_peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The dense peak of GPU_PEAK_TFLOPS for a GPU's name and a row's precision
    ('fp32', 'O1 bf16', 'O2 fp16', ...); None for a GPU or a type not there."""
    dtype = precision.split()[-1] if precision and precision.split()[-1] in ("fp16", "bf16") else "fp32"
    for pattern, peaks in GPU_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(dtype)
    return None


@functools.lru_cache(maxsize=None)
def training_gflop_per_image(arch: str, image_size: int) -> Optional[float]:
    """GFLOPs of one training image, forward and backward, as
    torch.utils.flop_counter counts them (convolutions and matrix products,
    2 per multiply-add; the cheap element-wise work is not counted): on the
    meta device, where nothing is computed, else on the CPU. ResNet-50 at
    224 px: 24.3 (its forward pass is the 8.2 usually quoted; the backward
    pass computes twice as much, less the first layer's unneeded input gradient)."""
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    images_counted = 2  # BatchNorm wants more than one value per channel in training
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                model = torchvision.models.get_model(arch, num_classes=1000)
                images = torch.randn(images_counted, 3, image_size, image_size)
                target = torch.zeros(images_counted, dtype=torch.long)
            model.train()
            counter = FlopCounterMode(display=False)
            with counter:
                torch.nn.functional.cross_entropy(model(images), target).backward()
            return counter.get_total_flops() / images_counted / 1e9
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue  # an operation the meta device lacks: count on the CPU
    return None


def mfu_percent(images_per_second: float, gflop_per_image: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: the FLOP/s the model's arithmetic needs at this speed, over the peak."""
    return 100.0 * images_per_second * gflop_per_image / (peak_tflops * 1000.0)
