"""Augmentation past the crop and flip, from torchvision.transforms.v2:
--auto-augment's policies and --random-erase on each training image
(ImageAugmentation), --mixup-alpha and --cutmix-alpha on each batch
(BatchMixing). docs/recipes.md says what each does and where it comes from.

Every random draw is a function of the run's position, so a resumed run
draws what an uninterrupted one drew, and the data backends draw alike:

- An image's policy and erasing draw from torch's CPU generator right after
  its crop and flip, from the state common.data seeded for that image
  (seed, epoch, index). The pil and torchvision backends run them in the
  data-loading worker; the gpu backend's worker, which has no pixels yet,
  keeps the generator's state in the Encoded image, and the device runs the
  same transforms from that state (common.pipelines.replayed). The policy
  always works on the crop's uint8 tensor (the pil backend's too, as
  torchvision's ClassificationPresetTrain does for tensors), so the backends
  differ only by the crop's resampling.
- A micro-batch's mixing draws from a CPU generator seeded with
  (seed, epoch, step, rank, micro-batch), forked from the global one so
  nothing else (dropout on the CPU, images loaded in the training process
  with -j 0, the next batch prepared meanwhile) shifts it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch
from torchvision.transforms import v2


class _AugMix(v2.AugMix):
    """v2.AugMix whose Dirichlet weights come from the CPU generator whatever
    the image's device: v2.AugMix samples them on the image's device, so a
    GPU replay of a worker's draws would take them from the CUDA generator."""

    def _sample_dirichlet(self, params: torch.Tensor) -> torch.Tensor:
        return super()._sample_dirichlet(params.cpu()).to(params.device)


def auto_augment_policy(name: str, ra_magnitude: int = 9, augmix_severity: int = 3) -> v2.Transform:
    """--auto-augment's policy by its torchvision references' name (config.AUTO_AUGMENT_POLICIES),
    with their defaults: nearest interpolation (AugMix: bilinear), black fill."""
    if name == "ta_wide":
        return v2.TrivialAugmentWide()
    if name == "ra":
        return v2.RandAugment(magnitude=ra_magnitude)
    if name == "augmix":
        return _AugMix(severity=augmix_severity)
    if name == "imagenet":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    raise ValueError(f"unknown auto-augment policy {name!r}")


@dataclasses.dataclass(frozen=True)
class ImageAugmentation:
    """--auto-augment and --random-erase of a training image, in the order of
    torchvision's ClassificationPresetTrain: the policy on the cropped and
    flipped uint8 image, the erasing on the normalised one (value 0). The
    backends that normalise on the device erase the uint8 image instead, with
    the normalisation's mean rounded to gray levels (`uint8`): within half a
    gray level of 0 once normalised, and the same box, drawn alike."""

    policy: Optional[str] = None  # config.AUTO_AUGMENT_POLICIES; None: none
    ra_magnitude: int = 9
    augmix_severity: int = 3
    erase_probability: float = 0.0

    @staticmethod
    def of(policy: Optional[str], ra_magnitude: int, augmix_severity: int,
           erase_probability: float) -> Optional["ImageAugmentation"]:
        """The run's augmentation, or None where it asks for none."""
        if policy is None and not erase_probability:
            return None
        return ImageAugmentation(policy, ra_magnitude, augmix_severity, erase_probability)

    def policy_transform(self) -> Optional[v2.Transform]:
        return None if self.policy is None else auto_augment_policy(self.policy, self.ra_magnitude,
                                                                    self.augmix_severity)

    def erasing(self, value: Sequence[float]) -> Optional[v2.Transform]:
        """v2.RandomErasing with torchvision's box range, writing `value` (one per channel)."""
        return v2.RandomErasing(self.erase_probability, value=list(value)) if self.erase_probability else None

    def uint8(self, erase_gray_levels: Sequence[int]) -> v2.Transform:
        """The policy and the erasing of a 3 x S x S uint8 image (on any device), erasing with
        `erase_gray_levels`: the gray levels normalisation maps to 0."""
        return v2.Compose([step for step in (self.policy_transform(), self.erasing(erase_gray_levels))
                           if step is not None])


class BatchMixing:
    """--mixup-alpha and --cutmix-alpha: v2.MixUp and v2.CutMix, one of the
    two per micro-batch (v2.RandomChoice, as torchvision's references),
    on the device; the targets become probabilities (num_classes wide)."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int):
        self.mixup_alpha = mixup_alpha
        self.cutmix_alpha = cutmix_alpha
        choices = []
        if mixup_alpha:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        self.transform = v2.RandomChoice(choices)

    @staticmethod
    def of(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> Optional["BatchMixing"]:
        """The run's mixing, or None where both alphas are 0."""
        return BatchMixing(mixup_alpha, cutmix_alpha, num_classes) if mixup_alpha or cutmix_alpha else None

    def __call__(self, images: torch.Tensor, target: torch.Tensor, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(mixed images, probability targets) of a batch; its draws (which of
        the two, the share, CutMix's box) from a CPU generator seeded with `seed`."""
        with torch.random.fork_rng(devices=[]):  # v2's draws use the global CPU generator: left as it was
            torch.default_generator.manual_seed(seed)
            return self.transform(images, target)

    def describe(self) -> str:
        kinds = " and ".join(f"{name} alpha {alpha:g}" for name, alpha in (("MixUp", self.mixup_alpha),
                                                                          ("CutMix", self.cutmix_alpha)) if alpha)
        which = ", one of the two per batch" if self.mixup_alpha and self.cutmix_alpha else ""
        return (f"mixing: {kinds}{which}, soft targets; training top-1/top-5 count the label with the larger "
                f"share of each mixed image")
