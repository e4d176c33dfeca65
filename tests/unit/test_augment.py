"""Augmentation and mixing (common.augment): MixUp's and CutMix's targets
are the drawn shares of the two labels, a training step reseeded alike mixes
alike and counts top-1 against the larger share; each --auto-augment policy
and --random-erase draw the same operations, magnitudes and boxes for an
image on the pil, torchvision and gpu backends (the gpu backend's route run
on the CPU, as tests/unit/test_pipelines.py runs it); the flags' mistakes,
--data-backend dali's among them, are one line and exit status 2."""
import copy

import pytest
import torch
from torch import nn
from torchvision.transforms import v2
from torchvision.transforms.v2 import _auto_augment

from common import cli, data, device_input, distributed, engine, errors, measure, meters, pipelines, precision
from common import schedules, telemetry
from common.augment import BatchMixing, ImageAugmentation
from common.pipelines import EncodedImages, PILImages, TensorImages
from common.tools.demo_data import write_fake_imagenet

STD_255 = torch.tensor(pipelines.IMAGENET_STD).reshape(3, 1, 1) * 255.0  # normalised units -> gray levels
CLASSES = 5


def constant_images(count: int, size: int = 16) -> torch.Tensor:
    """Image i holds the value i + 1 everywhere: a mixed image tells which images, and how much of each."""
    return (torch.arange(count, dtype=torch.float32) + 1).reshape(count, 1, 1, 1).expand(count, 3, size, size).clone()


def one_hot(labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.one_hot(labels, CLASSES).float()


# --- mixing: the targets are the drawn shares ---

def test_mixup_targets_sum_to_one_and_are_the_drawn_share_of_both_labels():
    images, labels = constant_images(4), torch.tensor([0, 3, 1, 4])
    shares = set()
    for seed in range(8):
        mixed, target = BatchMixing(0.2, 0.0, CLASSES)(images, labels, seed)
        # Image 1 = share x 2 + (1 - share) x 1 (its predecessor in the batch, as v2.MixUp pairs them).
        share = float(mixed[1, 0, 0, 0]) - 1.0
        assert torch.allclose(mixed, share * images + (1 - share) * images.roll(1, 0), atol=1e-5)
        assert torch.allclose(target, share * one_hot(labels) + (1 - share) * one_hot(labels.roll(1, 0)), atol=1e-5)
        assert torch.allclose(target.sum(dim=1), torch.ones(4))
        shares.add(round(share, 4))
    assert len(shares) == 8 and all(0.0 <= share <= 1.0 for share in shares)  # one draw per seed


def test_cutmixs_share_is_the_pasted_boxs_area_fraction():
    images, labels = constant_images(3, size=20), torch.tensor([2, 0, 1])
    pasted_fractions = set()
    for seed in range(10):
        mixed, target = BatchMixing(0.0, 1.0, CLASSES)(images, labels, seed)
        for index in range(3):
            previous = (index - 1) % 3
            assert set(mixed[index].unique().tolist()) <= {index + 1.0, previous + 1.0}  # pasted, not blended
            pasted = float((mixed[index] == previous + 1.0).float().mean())
            expected = (1 - pasted) * one_hot(labels[index]) + pasted * one_hot(labels[previous])
            assert torch.allclose(target[index], expected, atol=1e-6)
            assert float(target[index].sum()) == pytest.approx(1.0)
        pasted_fractions.add(round(pasted, 4))
    assert len(pasted_fractions) >= 5 and any(0.0 < fraction < 1.0 for fraction in pasted_fractions)


def test_with_both_one_of_the_two_per_batch_drawn_from_the_seed_alone():
    images, labels = constant_images(4), torch.tensor([0, 1, 2, 3])
    mixing = BatchMixing(0.2, 1.0, CLASSES)
    kinds = []
    for seed in range(30):
        state = torch.default_generator.get_state()
        mixed, target = mixing(images, labels, seed)
        assert torch.equal(torch.default_generator.get_state(), state)  # the global generator is left alone
        again, again_target = mixing(images, labels, seed)
        assert torch.equal(mixed, again) and torch.equal(target, again_target)
        pasted = set(mixed.unique().tolist()) <= {1.0, 2.0, 3.0, 4.0}
        kinds.append("cutmix" if pasted else "mixup")
    assert 8 <= kinds.count("cutmix") <= 22  # a fair choice between the two, each batch


def mixing_trainer(model: nn.Module, criterion: nn.Module) -> engine.Trainer:
    ctx = distributed.single_process("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return engine.Trainer(model, criterion, optimizer, schedules.LRSchedule(0.5, 1), precision.FP32(), ctx,
                          telemetry.RunLog(ctx), mixing=BatchMixing(0.2, 1.0, CLASSES))


class RecordingLoss(nn.Module):
    """Cross-entropy with label smoothing that keeps the logits and targets it was given."""

    def __init__(self):
        super().__init__()
        self.loss = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.calls = []

    def forward(self, logits, target):
        self.calls.append((logits.detach().clone(), target.clone()))
        return self.loss(logits, target)


def test_a_step_reseeded_alike_mixes_alike_and_counts_top1_against_the_larger_share():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, CLASSES))
    images = torch.randn(6, 3, 16, 16)
    batch = data.Sample(images, torch.tensor([0, 1, 2, 3, 4, 0]), torch.zeros(6, dtype=torch.long),
                        torch.full((6,), -1), [""] * 6, torch.full((6,), -1))
    outcomes = {}
    for name, step in (("first", 3), ("again", 3), ("next step", 4)):
        criterion = RecordingLoss()
        trainer = mixing_trainer(copy.deepcopy(model), criterion)
        sums = meters.MetricSums(torch.device("cpu"))
        trainer._step(batch, iter(()), 0, step, 10, 7, sums, measure.StepTimer(10, 0, [torch.device("cpu")]),
                      data.BadImages(None))
        ((logits, target),) = criterion.calls
        assert target.shape == (6, CLASSES) and torch.allclose(target.sum(dim=1), torch.ones(6))
        totals = sums.totals()
        assert totals.top1_correct == int((logits.argmax(dim=1) == target.argmax(dim=1)).sum())
        assert totals.count == 6
        outcomes[name] = (target, list(trainer.model.parameters())[0].detach().clone())
    assert torch.equal(outcomes["first"][0], outcomes["again"][0])  # the same draws: the same targets, the same step
    assert torch.equal(outcomes["first"][1], outcomes["again"][1])
    assert not torch.equal(outcomes["first"][0], outcomes["next step"][0])


# --- per image: the same draws on every backend ---

@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> list:
    """ImageNet-shaped JPEGs (about 500 x 375, as test_pipelines' crop tests use)."""
    root = tmp_path_factory.mktemp("augment") / "tree"
    write_fake_imagenet(root, classes=1, train_per_class=6, val_per_class=1)
    return sorted(str(path) for path in (root / "train").rglob("*.JPEG"))


@pytest.fixture
def one_thread():
    """One torch thread, as in a data-loading worker: the policies' small ops (a 64-pixel Sharpness: 0.7 ms)
    take 100x longer when a loaded 2-core machine's threads contend for them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Draws:
    """What the policies and the erasing drew, in order: each operation and its magnitude, AugMix's
    Dirichlet weights, each erased box."""

    def __init__(self, monkeypatch):
        self.drawn = []
        apply, dirichlet, erase = (_auto_augment._AutoAugmentBase._apply_image_or_video_transform,
                                   v2.AugMix._sample_dirichlet, v2.RandomErasing.make_params)

        def recorded_apply(transform, image, transform_id, magnitude, **options):
            self.drawn.append((transform_id, round(magnitude, 5)))
            return apply(transform, image, transform_id, magnitude, **options)

        def recorded_dirichlet(transform, params):
            weights = dirichlet(transform, params)
            self.drawn.append(("dirichlet", tuple(round(w, 5) for w in weights.flatten().tolist())))
            return weights

        def recorded_box(transform, flat_inputs):
            params = erase(transform, flat_inputs)
            if params["v"] is not None:  # None: no box found in its 10 tries, nothing erased
                self.drawn.append(("erase", params["i"], params["j"], params["h"], params["w"]))
            return params

        monkeypatch.setattr(_auto_augment._AutoAugmentBase, "_apply_image_or_video_transform", recorded_apply)
        monkeypatch.setattr(v2.AugMix, "_sample_dirichlet", recorded_dirichlet)
        monkeypatch.setattr(v2.RandomErasing, "make_params", recorded_box)

    def taken(self) -> list:
        drawn, self.drawn = self.drawn, []
        return drawn


def every_backend(path: str, seed: int, augmentation: ImageAugmentation, draws: Draws, size: int = 64) -> dict:
    """{backend: (image, draws)}: pil's normalised float image, torchvision's and gpu's uint8 ones."""
    backends = {"pil": PILImages(pipelines.train_transform(size, augmentation=augmentation)),
                "torchvision": TensorImages(True, size, reduced_decode=False, augmentation=augmentation),
                "gpu": EncodedImages(True, size, reduced_decode=False, augmentation=augmentation)}
    made = {}
    for name, backend in backends.items():
        torch.manual_seed(seed)  # as common.data seeds each image
        image = backend(path).image
        if name == "gpu":  # the worker's Encoded, collated, decoded and augmented where the GPU would
            assert isinstance(image, pipelines.Encoded) and image.generator_state is not None
            image = data.collate([data.Sample(image, 0, 0)]).image.decode(torch.device("cpu"))[0]
        made[name] = (image, draws.taken())
    return made


@pytest.mark.parametrize("policy", ["ta_wide", "ra", "augmix", "imagenet"])
def test_each_policy_draws_the_same_operations_on_every_backend(jpegs, monkeypatch, one_thread, policy):
    draws = Draws(monkeypatch)
    augmentation = ImageAugmentation(policy, ra_magnitude=12, augmix_severity=5)
    operations = set()
    for seed in range(10):
        made = every_backend(jpegs[seed % len(jpegs)], seed, augmentation, draws)
        (pil, pil_draws), (fast, fast_draws), (gpu, gpu_draws) = made["pil"], made["torchvision"], made["gpu"]
        assert pil_draws == fast_draws == gpu_draws, seed  # AutoAugment's may apply none of its pair
        operations.update(draw[0] for draw in pil_draws)
        assert torch.equal(gpu, fast)  # the same transforms on the same crop: the same pixels
        difference = ((pil - device_input.normalize(fast)) * STD_255).abs()
        # The crops differ by at most a gray level (Pillow's resampling and torch's); Posterize, Solarize and
        # Equalize turn such a difference at a threshold into a larger one, at a few pixels.
        assert difference.mean() <= 0.3, (seed, difference.mean())
        assert (difference > 1.001).float().mean() <= 0.005, (seed, (difference > 1.001).float().mean())
    assert len(operations - {"dirichlet"}) >= 5  # the policy's operations, not one of them over and over


def test_random_erasing_erases_the_same_box_on_every_backend(jpegs, monkeypatch, one_thread):
    draws = Draws(monkeypatch)
    augmentation = ImageAugmentation(None, erase_probability=0.5)
    erased = 0
    for seed in range(12):
        made = every_backend(jpegs[seed % len(jpegs)], seed, augmentation, draws)
        boxes = {name: [draw for draw in drawn if draw[0] == "erase"] for name, (_, drawn) in made.items()}
        assert boxes["pil"] == boxes["torchvision"] == boxes["gpu"], seed
        if not boxes["pil"]:  # not drawn for this image (p = 0.5): nothing erased anywhere
            continue
        erased += 1
        ((_, top, left, height, width),) = boxes["pil"]
        inside = (slice(None), slice(top, top + height), slice(left, left + width))
        pil, fast = made["pil"][0], made["torchvision"][0]
        assert torch.equal(pil[inside], torch.zeros_like(pil[inside]))  # torchvision's value on the normalised image
        levels = torch.tensor(pipelines.MEAN_GRAY_LEVELS, dtype=torch.uint8).reshape(3, 1, 1)
        assert torch.equal(fast[inside], levels.expand_as(fast[inside]))  # the mean, in gray levels
        assert (device_input.normalize(fast)[inside] * STD_255).abs().max() <= 0.5  # within half a level of 0
        assert torch.equal(made["gpu"][0], fast)
    assert 3 <= erased <= 10


def test_the_gpu_backends_replay_leaves_the_training_processs_generator_alone(jpegs, one_thread):
    augmentation = ImageAugmentation("ta_wide", erase_probability=1.0)
    torch.manual_seed(3)
    encoded = EncodedImages(True, 64, augmentation=augmentation)(jpegs[0]).image
    batch = data.collate([data.Sample(encoded, 0, 0)]).image
    torch.manual_seed(11)
    state = torch.default_generator.get_state()
    first = batch.decode(torch.device("cpu"))
    assert torch.equal(torch.default_generator.get_state(), state)
    assert torch.equal(batch.decode(torch.device("cpu")), first)  # replayed from the image's state each time


@pytest.mark.gpu
def test_the_gpu_backend_draws_on_the_gpu_what_the_worker_would_have(jpegs, monkeypatch):
    draws = Draws(monkeypatch)
    for policy in ("ta_wide", "augmix"):
        augmentation = ImageAugmentation(policy, erase_probability=0.5)
        for seed in range(6):
            torch.manual_seed(seed)
            encoded = EncodedImages(True, 64, reduced_decode=False, augmentation=augmentation)(jpegs[seed]).image
            batch = data.collate([data.Sample(encoded, 0, 0)]).image
            on_cpu, cpu_draws = batch.decode(torch.device("cpu"))[0], draws.taken()
            on_gpu, gpu_draws = batch.decode(torch.device("cuda"))[0].cpu(), draws.taken()
            assert cpu_draws == gpu_draws, (policy, seed)
            # nvJPEG and libjpeg-turbo decode a level or two apart, which Equalize may double; other draws would
            # differ by tens of levels. (Not yet run on a GPU: the session that wrote it had none.)
            assert (on_cpu.float() - on_gpu.float()).abs().mean() <= 6.0, (policy, seed)


# --- the flags ---

def test_the_flags_reach_the_config_and_the_pipelines(tiny_data):
    cfg = cli.parse("nd", [str(tiny_data), "--auto-augment", "ra", "--ra-magnitude", "15", "--random-erase", "0.25",
                           "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"])
    assert (cfg.auto_augment, cfg.ra_magnitude, cfg.augmix_severity, cfg.random_erase, cfg.mixup_alpha,
            cfg.cutmix_alpha) == ("ra", 15, 3, 0.25, 0.2, 1.0)
    policy, erasing = data.pipeline(cfg, train=True).augment.transforms
    assert isinstance(policy, v2.RandAugment) and policy.magnitude == 15
    assert isinstance(erasing, v2.RandomErasing) and erasing.p == 0.25
    assert data.pipeline(cfg, train=False).augment is None  # validation images are not augmented
    plain = cli.parse("nd", [str(tiny_data)])
    assert data.pipeline(plain, train=True).augment is None
    assert BatchMixing.of(plain.mixup_alpha, plain.cutmix_alpha, 3) is None


def test_synthetic_data_says_its_images_are_not_augmented():
    cfg = cli.parse("nd", ["--synthetic", "--auto-augment", "ta_wide", "--mixup-alpha", "0.2", "-b", "2"])
    *_, notes = data.build_datasets(cfg, distributed.single_process("cpu"))
    assert notes == ["note: --synthetic: its random images are not augmented (--auto-augment, --random-erase); "
                     "--mixup-alpha and --cutmix-alpha still mix its batches"]


@pytest.mark.parametrize("argv, message", [
    (["--data-backend", "dali", "--auto-augment", "ta_wide"],
     "argument --auto-augment: not with --data-backend dali (its pipeline on the device does not apply it; "
     "use gpu, torchvision or pil)"),
    (["--data-backend", "dali", "--random-erase", "0.1"],
     "argument --random-erase: not with --data-backend dali (its pipeline on the device does not apply it; "
     "use gpu, torchvision or pil)"),
    (["--ra-magnitude", "12"], "argument --ra-magnitude: only with --auto-augment ra (this run: none)"),
    (["--auto-augment", "ra", "--augmix-severity", "5"],
     "argument --augmix-severity: only with --auto-augment augmix (this run: ra)"),
    (["--ra-magnitude", "31"], "argument --ra-magnitude: expected a magnitude bin from 0 to 30, got 31"),
    (["--random-erase", "1.5"], "argument --random-erase: expected a probability in [0, 1], got 1.5"),
    (["--mixup-alpha", "0.001"], "argument --mixup-alpha: expected 0 (off) or from 0.01 to 1e+06, got 0.001"),
    (["--cutmix-alpha", "1e300"], "argument --cutmix-alpha: expected 0 (off) or from 0.01 to 1e+06, got 1e300"),
])
def test_mistakes_are_one_line_and_exit_status_2(argv, message, capsys):
    with pytest.raises(errors.UsageError) as caught:
        cli.parse("nd", ["--synthetic", *argv])
    assert errors.exit_status(caught.value) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and message in lines[0], lines
