"""Resolution and sampling (docs/recipes.md): FixRes's three sizes, FFCV's
progressive resizing and test-time flip, repeated augmentation. Exact sizes
per epoch, the crop every backend hands validation, flip-averaged logits,
and the repeated-augmentation order: its per-rank multiset, its copies'
own crops, and a resume that gives the rest of it."""
import dataclasses
import itertools
from collections import Counter

import pytest
import torch
from torch import nn

from common import cli, data, dali, engine, models, precision, schedules, telemetry
from common.config import progressive_crop_size
from common.data import RepeatedAugmentationSampler, build_loaders
from common.device_input import DeviceInput
from common.distributed import single_process
from common.errors import UsageError
from helpers import DALI_INSTALLED, make_image_folder, memory_capped

CPU = single_process("cpu")
# 24 training images (3 classes x 8) and 9 validation ones, 24 px: crops are resized up or down.
SMALL = ["-a", "resnet18", "-b", "4", "-p", "100"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("resolution") / "data")


# --- progressive resizing: the training crop of each epoch ---

@pytest.mark.parametrize("schedule, epochs, expected", [
    # FFCV's ResNet-50 16-epoch and 88-epoch configs (rn50_configs/): 160 -> 192 over 11..13 and 65..76. Rounded
    # to multiples of 32 (halves to even, as numpy.round), the ramp is a jump at its middle: epoch 12 is
    # 176 / 32 = 5.5 -> 6 -> 192, epoch 70 is 174.5 / 32 -> 5 -> 160, epoch 71 is 177.5 / 32 -> 6 -> 192.
    (["160", "192", "11", "13"], 16, [160] * 12 + [192] * 4),
    (["160", "192", "65", "76"], 88, [160] * 71 + [192] * 17),
    # Steps of 8: 168, 176, 184 in between; the sizes beyond END_EPOCH are MAX.
    (["160", "192", "10", "14", "--progressive-step", "8"], 16, [160] * 11 + [168, 176, 184] + [192] * 2),
    # MIN and MAX that are no multiple of the step: the rounded sizes stay within them (epoch 1: 16 / 32 = 0.5
    # rounds to 0, which is no size: MIN).
    (["8", "40", "0", "4"], 5, [8, 8, 32, 32, 40]),
])
def test_the_training_crop_of_each_epoch_is_ffcvs_progressive_resizing(schedule, epochs, expected):
    cfg = cli.parse("nd", ["--synthetic", "--epochs", str(epochs), "--progressive-resizing", *schedule])
    assert [cfg.crop_sizes.train(epoch) for epoch in range(epochs)] == expected
    assert progressive_crop_size(7, 160, 192, 7, 7, 32) == 160  # START_EPOCH == END_EPOCH: MIN up to it
    without = cli.parse("nd", ["--synthetic", "--image-size", "176"]).crop_sizes
    assert {without.train(epoch) for epoch in range(90)} == {176} and without.val == 176


@pytest.mark.parametrize("backend, workers", [("torchvision", "1"), ("pil", "0")])
def test_each_epochs_batches_have_its_crop_size_in_the_data_loading_workers_too(tiny, backend, workers):
    cfg = cli.parse("nd", [str(tiny), *SMALL, "-j", workers, "--data-backend", backend, "--image-size", "32",
                           "--val-resize", "32", "--progressive-resizing", "16", "32", "0", "2",
                           "--progressive-step", "8"])
    loaders = build_loaders(cfg, CPU)
    sizes = []
    for epoch in (0, 1, 2, 3, 1):  # back to epoch 1: a pure function of the epoch, as a resume needs
        loaders.set_epoch(epoch)
        sizes.append({tuple(batch.image.shape[1:]) for batch in loaders.train})
    assert sizes == [{(3, side, side)} for side in (16, 24, 32, 32, 24)]
    assert {tuple(batch.image.shape[1:]) for batch in loaders.val} == {(3, 32, 32)}  # --image-size


def test_synthetic_images_follow_the_epochs_crop_and_the_validation_crop():
    cfg = cli.parse("nd", ["--synthetic", "-b", "2", "--image-size", "32", "--val-resize", "40",
                           "--val-crop-size", "40", "--progressive-resizing", "8", "24", "1", "2"])
    loaders = build_loaders(cfg, CPU)
    for epoch, side in ((0, 8), (1, 8), (2, 24)):
        loaders.set_epoch(epoch)
        image = loaders.train.dataset[5]
        assert image.image.shape == (3, side, side) and image.image.dtype == torch.uint8
    assert loaders.val.dataset[0].image.shape == (3, 40, 40)
    plain = build_loaders(cli.parse("nd", ["--synthetic", "-b", "2", "--image-size", "32", "--val-resize", "32"]),
                          CPU)
    # Without the new flags the images are the pool's as before: the whole 32 px, interleaved in memory.
    image = plain.train.dataset[3].image
    assert image.shape == (3, 32, 32) and torch.equal(image, plain.train.dataset.pool[3])
    assert image.permute(1, 2, 0).is_contiguous()


# --- FixRes: the validation crop of every backend ---

def _val_cfg(root, backend):
    return cli.parse("nd", [str(root), *SMALL, "-j", "0", "--data-backend", backend, "--image-size", "32",
                            "--val-resize-size", "28", "--val-crop-size", "20"])


def test_the_pil_and_torchvision_backends_validate_at_the_val_crop_size(tiny):
    batches = {}
    for backend in ("pil", "torchvision"):
        cfg = _val_cfg(tiny, backend)
        assert (cfg.image_size, cfg.val_resize, cfg.val_crop_size) == (32, 28, 20)
        loaders = build_loaders(cfg, CPU)
        loaders.set_epoch(0)
        assert next(iter(loaders.train)).image.shape[1:] == (3, 32, 32)
        batches[backend] = [DeviceInput(torch.device("cpu")).batch(batch) for batch in loaders.val]
    assert [batch.image.shape for batch in batches["pil"]] == [(4, 3, 20, 20)] * 2 + [(1, 3, 20, 20)]
    for reference, fast in zip(batches["pil"], batches["torchvision"]):  # the same centre crops
        assert fast.image.shape == reference.image.shape
        assert ((reference.image - fast.image) * 255 * 0.229).abs().max() <= 1.5


def _val_files(root):
    return sorted(str(path) for path in (root / "val").rglob("*.JPEG"))


def test_the_gpu_backends_workers_hand_the_val_crop_size_to_the_device(tiny):
    """The gpu backend's CPU side: each file's geometry asks for the
    validation crop, and the batch decodes (here on the CPU) to the
    torchvision backend's images."""
    encoder = data.pipeline(_val_cfg(tiny, "gpu"), train=False)
    fast = data.pipeline(_val_cfg(tiny, "torchvision"), train=False)
    loaded = [encoder(path) for path in _val_files(tiny)]
    assert {item.image.geometry.image_size for item in loaded} == {20}
    assert {item.image.geometry.val_resize for item in loaded} == {28}
    batch = data.collate([data.Sample(item.image, 0, item.file_bytes) for item in loaded])
    decoded = batch.image.decode(torch.device("cpu"))
    assert decoded.shape == (9, 3, 20, 20)
    assert torch.equal(decoded, torch.stack([fast(path).image for path in _val_files(tiny)]))


@pytest.mark.skipif(not DALI_INSTALLED, reason="NVIDIA DALI is not installed (pip install -r requirements-dali.txt)")
def test_dali_decodes_the_val_crop_and_each_training_crop_size_in_one_pipeline(tiny):
    decoder = dali.DaliDecoder(torch.device("cpu"), max_batch=9, threads=1)
    fast = data.pipeline(_val_cfg(tiny, "torchvision"), train=False)
    files = _val_files(tiny)
    for train, size in ((False, 20), (True, 16), (True, 24), (False, 20)):
        cfg = _val_cfg(tiny, "dali")
        encoder = data.pipeline(cfg, train=train, image_size=size if train else None)
        batch = data.collate([data.Sample(encoder(path).image, 0, 0) for path in files])
        decoded = batch.image.decode(torch.device("cpu"), decoder)
        assert decoded.shape == (9, 3, size, size)
        if not train:  # DALI's resampling: within a few gray levels of the torchvision backend's
            expected = torch.stack([fast(path).image for path in files])
            assert (decoded.int() - expected.int()).abs().max() <= 4


# --- the checks: sizes against each other, the machine and the model ---

@pytest.mark.parametrize("flags, message", [
    (["--val-resize-size", "200", "--val-crop-size", "224"], "argument --val-resize: 200 is smaller than "
                                                             "--val-crop-size 224"),
    (["--progressive-resizing", "192", "160", "0", "4"], "argument --progressive-resizing: MIN_PX 192 is above "
                                                         "MAX_PX 160"),
    (["--progressive-resizing", "160", "192", "5", "4"], "argument --progressive-resizing: START_EPOCH 5 is after "
                                                         "END_EPOCH 4"),
    (["--progressive-resizing", "0", "192", "0", "4"], "argument --progressive-resizing: MIN_PX 0 is no size"),
    (["--progressive-resizing", "16", str(10**9), "0", "4"],
     "argument --progressive-resizing: one 1000000000x1000000000 image as float32 input would take"),
    (["-b", str(10**6), "--image-size", "8", "--val-crop-size", "224"],
     "argument -b/--batch-size: a batch of 1000000 224x224 images as float32 input (-b 1000000 at --val-crop-size "
     "224) would take"),
    (["-b", str(10**6), "--image-size", "8", "--val-resize", "8", "--progressive-resizing", "8", "224", "0", "1"],
     "argument -b/--batch-size: a batch of 1000000 224x224 images as float32 input (-b 1000000 at "
     "--progressive-resizing 224) would take"),
])
def test_sizes_that_cannot_work_together_or_fit_are_one_line_naming_the_flag(flags, message):
    with memory_capped(), pytest.raises(UsageError) as refused:
        cli.parse("nd", ["--synthetic", *flags])
    assert str(refused.value).startswith(message), str(refused.value)
    # FixRes's direction is fine: a training crop larger than the validation resize, with a smaller val crop.
    cfg = cli.parse("nd", ["--synthetic", "--image-size", "300", "--val-resize", "256", "--val-crop-size", "224"])
    assert (cfg.crop_sizes.train(0), cfg.crop_sizes.val) == (300, 224)


def test_the_model_is_checked_at_the_val_crop_and_the_progressive_sizes_naming_their_flags():
    cfg = cli.parse("nd", ["--synthetic", "-a", "alexnet", "--val-crop-size", "32", "--val-resize", "256"])
    assert cfg.crop_sizes.model_inputs() == (("--val-crop-size", 32),)
    with pytest.raises(UsageError, match=r"^argument --val-crop-size: alexnet cannot take 32-pixel images"):
        models.build_model("alexnet", 5, image_size=224, other_sizes=cfg.crop_sizes.model_inputs())
    cfg = cli.parse("nd", ["--synthetic", "-a", "alexnet", "--progressive-resizing", "48", "224", "0", "4"])
    assert cfg.crop_sizes.model_inputs() == (("--progressive-resizing", 48),)  # 224 is --image-size's, checked
    with pytest.raises(UsageError, match=r"^argument --progressive-resizing: alexnet cannot take 48-pixel images"):
        models.build_model("alexnet", 5, image_size=224, other_sizes=cfg.crop_sizes.model_inputs())
    # -b 1 is checked at the smallest training crop, where BatchNorm runs out of values first.
    with pytest.raises(UsageError, match=r"^argument -b/--batch-size: one image per step is too few for resnet18 "
                                         r"at 16-pixel images"):
        cli.parse("nd", ["--synthetic", "-a", "resnet18", "-b", "1", "--progressive-resizing", "16", "224", "0", "2"])


# --- the size of each epoch, said and recorded ---

class _AnySize(nn.Module):
    """A model that takes any image size and is not mirror-symmetric."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 4, 3)

    def forward(self, images):
        return self.fc(nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(images)), (1, 4)).flatten(1))


def _trainer(cfg, model, **options) -> engine.Trainer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return engine.Trainer(model, nn.CrossEntropyLoss(), optimizer, schedules.LRSchedule(0.01, cfg.epochs),
                          precision.FP32(), CPU, telemetry.RunLog(CPU), print_freq=100, crop_sizes=cfg.crop_sizes,
                          **options)


def test_each_new_training_crop_is_said_once_and_recorded_in_the_epochs_rows(tiny, capsys):
    cfg = cli.parse("nd", [str(tiny), *SMALL, "-b", "8", "-j", "0", "--epochs", "3", "--image-size", "32",
                           "--val-resize", "32", "--val-crop-size", "24", "--progressive-resizing", "16", "32", "1",
                           "3", "--progressive-step", "16"])
    loaders = build_loaders(cfg, CPU)
    trainer = _trainer(cfg, _AnySize(), compile=True)
    rows = []
    for epoch in range(3):
        rows += [trainer.train_one_epoch(loaders, epoch).metrics, trainer.validate(loaders, epoch)[0]]
    said = [line for line in capsys.readouterr().out.splitlines() if " crop " in line]
    assert said == ["epoch 0: training crop 16 px",
                    "epoch 0: validation crop 24 px (--compile: compiled for this size, once)",
                    "epoch 2: training crop 32 px (--compile: compiled for this size, once)"]
    # Epoch 2, half-way: 16 + 16 / 2 = 24 px, 24 / 16 = 1.5 rounds to 2 (halves to even): 32 px.
    assert [(row.split, row.image_size) for row in rows] == [
        ("train", 16), ("val", 24), ("train", 16), ("val", 24), ("train", 32), ("val", 24)]


# --- test-time flip ---

def test_val_flip_counts_loss_and_accuracy_from_the_mean_of_each_image_and_its_mirrors_logits(tiny):
    cfg = cli.parse("nd", [str(tiny), *SMALL, "-j", "0", "--image-size", "16", "--val-resize", "24", "--val-flip"])
    loaders = build_loaders(cfg, CPU)
    model = _AnySize()
    flipped = _trainer(cfg, model, val_flip=cfg.val_flip).validate(loaders, 0)[0]
    plain = _trainer(cfg, model).validate(loaders, 0)[0]
    images, targets = zip(*[(batch.image, batch.target) for batch in DeviceInput(torch.device("cpu"))(loaders.val)])
    images, targets = torch.cat(images), torch.cat(targets)
    with torch.no_grad():
        mean = (model(images) + model(torch.flip(images, dims=[3]))) / 2
        unflipped = model(images)
    assert flipped.images == plain.images == 9
    assert flipped.loss == pytest.approx(nn.functional.cross_entropy(mean, targets).item(), abs=1e-6)
    assert flipped.top1 == pytest.approx(100.0 * (mean.argmax(1) == targets).sum().item() / 9)
    assert plain.loss == pytest.approx(nn.functional.cross_entropy(unflipped, targets).item(), abs=1e-6)
    assert abs(flipped.loss - plain.loss) > 1e-4  # the mirror images changed the logits


# --- repeated augmentation ---

def _shares(length, world, batch, reps, epoch=0, images_done=0, seed=3):
    samplers = [RepeatedAugmentationSampler(length, rank, world, batch, seed, repetitions=reps)
                for rank in range(world)]
    steps = [sampler.set_epoch(epoch, images_done) for sampler in samplers][0]
    return steps, [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("world, reps", list(itertools.product([1, 2, 3], [2, 3])))
def test_repeated_augmentation_trains_each_drawn_image_k_times_spread_over_the_ranks(world, reps):
    length, batch = 24, 2  # global batches of 2, 4, 6: the 24 positions are whole ones
    steps, shares = _shares(length, world, batch, reps)
    assert len(steps) == length // (batch * world) and [len(share) for share in shares] == [length // world] * world
    every = Counter(key for share in shares for key in share)
    assert set(every.values()) == {1}  # every (image, copy) once
    images = Counter(index for index, _ in every)
    permutation = torch.randperm(length, generator=torch.Generator().manual_seed(3)).tolist()
    assert images == {index: reps for index in permutation[:length // reps]}  # the permutation's first len/K, K times
    if world >= reps:  # each copy of an image on another rank
        for index in images:
            ranks = [rank for rank, share in enumerate(shares) for key in share if key[0] == index]
            assert len(set(ranks)) == reps
    _, other_epoch = _shares(length, world, batch, reps, epoch=1)
    assert other_epoch != shares


@pytest.mark.parametrize("world, new_world", [(2, 2), (2, 3), (3, 1)])
def test_a_repeated_augmentation_epoch_resumed_at_step_s_gives_the_rest_of_its_order(world, new_world):
    length, batch, reps = 36, 2, 3
    order = [(index, copy) for index in torch.randperm(length, generator=torch.Generator().manual_seed(3 + 1)).tolist()
             for copy in range(reps)][:length]  # epoch 1's order: each image 3 times in a row

    def global_batches(shares, steps):  # global batch k: every rank's k-th batch
        return [sorted(key for share in shares for key in share[k * batch:(k + 1) * batch]) for k in range(steps)]

    steps, shares = _shares(length, world, batch, reps, epoch=1)
    assert global_batches(shares, len(steps)) == [sorted(order[k * batch * world:(k + 1) * batch * world])
                                                  for k in range(len(steps))]
    for done in range(len(steps) + 1):
        images_done = done * batch * world
        rest_steps, rest = _shares(length, new_world, batch, reps, epoch=1, images_done=images_done)
        if new_world == world:  # each rank's share goes on where it stopped
            assert rest == [share[done * batch:] for share in shares]
        size = batch * new_world
        assert global_batches(rest, len(rest_steps)) == [
            sorted(order[images_done + k * size:images_done + (k + 1) * size]) for k in range(len(rest_steps))]
        assert rest_steps.stop == length // size


def test_each_copy_of_an_image_is_cropped_on_its_own_whichever_rank_reads_it(tiny):
    cfg = cli.parse("ddp", [str(tiny), *SMALL, "-j", "1", "--image-size", "16", "--val-resize", "16",
                            "--ra-sampler", "--ra-reps", "3"])

    def images_by_key(world_size):
        seen = {}
        for rank in range(world_size):
            loaders = build_loaders(cfg, dataclasses.replace(CPU, rank=rank, world_size=world_size))
            loaders.set_epoch(1)
            keys = list(loaders.train.sampler)
            seen.update(zip(keys, torch.cat([batch.image for batch in loaders.train])))
        return seen

    one, three = images_by_key(1), images_by_key(3)
    assert sorted(one) == sorted(three) and len(one) == 24  # 8 images x 3 copies
    assert all(torch.equal(one[key], three[key]) for key in one)  # a copy's crop is its own, not its rank's
    for index in {index for index, _ in one}:
        copies = [one[(index, copy)] for copy in range(3)]
        assert not any(torch.equal(a, b) for a, b in itertools.combinations(copies, 2))
    # The first copy is cropped as a plain epoch crops the image.
    plain = build_loaders(dataclasses.replace(cfg, ra_sampler=False), CPU)
    plain.set_epoch(1)
    assert all(torch.equal(plain.train.dataset[index].image, one[(index, 0)]) for index in {i for i, _ in one})
    # Validation is untouched: every image once.
    assert list(build_loaders(cfg, CPU).val.sampler) == list(range(9))
