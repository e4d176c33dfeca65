"""What a measured process does (python -m common.tools.bench --child SPEC,
started by processes.run_child): the plain references, written out in full
as users know them (the training loop and the input pipeline); the project's
input pipeline timed alone; DALI's decoders alone (the decode section); and
the comm and scaling sections' processes
(comm_bench). Also the file order every input measurement reads in, whose
files the sections read once beforehand (warm_page_cache).
"""
from __future__ import annotations

import functools
import importlib
import os
import resource
import time
from pathlib import Path
from typing import Dict

SCALING_POWERSGD_START_STEP = 2  # the first step PowerSGD may compress at (common.comm): within the warm-up


# --- the plain references, written out in full, as users know them ---

def reference_train_loop(arch: str, batch_size: int, image_size: int, device: str, warmup_steps: int,
                         steps: int) -> Dict[str, float]:
    """The plain training loop on one synthetic batch: fp32, NCHW,
    torch.optim.SGD's defaults, .item() every step. Times `steps` steps after
    `warmup_steps`, with the device synchronised at both ends."""
    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True  # as the scripts (and pytorch/examples) set it: fixed input sizes
    model = torchvision.models.get_model(arch, num_classes=1000).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    criterion = torch.nn.CrossEntropyLoss()
    images = torch.randn(batch_size, 3, image_size, image_size, device=device)
    target = torch.randint(0, 1000, (batch_size,), device=device)
    model.train()
    started = None
    for step in range(warmup_steps + steps):
        if step == warmup_steps:
            _synchronize(device)
            started = time.perf_counter()
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
    _synchronize(device)
    seconds = time.perf_counter() - started
    return {"images_per_second": steps * batch_size / seconds, "ms_per_step": 1000.0 * seconds / steps,
            "peak_memory_mib": _peak_memory_mib(device)}


def reference_input(root: str, image_size: int, batch_size: int, workers: int):
    """The plain input pipeline: ImageFolder, Pillow transforms to float32, default collation."""
    import torch
    from torchvision import datasets, transforms

    from common.pipelines import IMAGENET_MEAN, IMAGENET_STD

    transform = transforms.Compose([
        transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    dataset = datasets.ImageFolder(os.path.join(root, "train"), transform)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=_same_order(len(dataset), batch_size),
                                       num_workers=workers, drop_last=True, pin_memory=torch.cuda.is_available())


def _same_order(length: int, batch_size: int):
    """The shuffle every configuration of the input section reads in (the
    project's epoch-0 order, seed 0, which the scripts' first epoch also
    takes), so all read the same files."""
    from common.data import TrainSampler

    sampler = TrainSampler(length, rank=0, world_size=1, batch_size=batch_size, seed=0)
    sampler.set_epoch(0)
    return sampler


def warm_page_cache(root: str, images: int, batch_size: int) -> None:
    """Read once the files the first `images` of that order name, which the
    input and end-to-end sections will read, so that no configuration (nor
    repeat) is timed on a colder file cache than another."""
    from common.dataset_lists import scan_split

    _, samples = scan_split(Path(root, "train"))
    for index in list(_same_order(len(samples), batch_size))[:images]:
        Path(samples[index][0]).read_bytes()


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_memory_mib(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux: this process's peak


# --- the storage section: the read stage alone ---

class OpenCounter:
    """The files this process opens under `roots` (builtins.open, io.open and
    os.open wrapped while it is entered): a measured process's own count, which
    its forked data-loading workers inherit and keep, each its own."""

    def __init__(self, roots):
        self.roots = tuple(os.path.realpath(root) + os.sep for root in roots if root)
        self.opens = 0
        self._saved = None

    def _counted(self, function):
        def opened(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(file)).startswith(
                    self.roots):
                self.opens += 1
            return function(file, *args, **kwargs)
        return opened

    def __enter__(self) -> "OpenCounter":
        import builtins
        import io

        self._saved = (builtins.open, io.open, os.open)
        builtins.open = io.open = self._counted(builtins.open)
        os.open = self._counted(os.open)
        return self

    def __exit__(self, *exc_info) -> None:
        import builtins
        import io

        builtins.open, io.open, os.open = self._saved


class StorageReads:
    """The read stage of a training epoch: image `index`'s bytes, from a
    folder tree (one file each) or from shards (common.shards: a byte range
    of a shard, through the store and the node-local cache); each item is
    (image bytes, bytes from the source, bytes from the cache, files opened)."""

    def __init__(self, spec: dict, counter: OpenCounter):
        self.counter = counter
        self.paths, self.split = None, None
        if spec["format"] == "folder":
            from common.dataset_lists import scan_split

            _, samples = scan_split(Path(spec["data"], "train"))
            self.paths = [path for path, _ in samples]
        else:
            from common.shards import open_sharded

            self.split = open_sharded(spec["data"], spec.get("cache"), spec.get("cache_bytes", 0),
                                      spec.get("endpoint_url")).train

    def __len__(self) -> int:
        return len(self.paths) if self.paths is not None else len(self.split)

    def order(self, how: str, batch_size: int):
        """Indices as the trainer reads them (`permutation`: TrainSampler's epoch 0,
        seed 0) or as a sequential reader does (`shard`: each shard front to back)."""
        if how == "shard":
            import numpy as np

            return np.lexsort((self.split.arrays["offset"], self.split.arrays["shard"])).tolist()
        return list(_same_order(len(self), batch_size))

    def __getitem__(self, index: int):
        from common.image_files import read_file

        before = self.counter.opens
        if self.paths is not None:
            data = read_file(self.paths[index])
            return len(data), len(data), 0, self.counter.opens - before
        fetched = self.split.read(index)
        return len(fetched.data), fetched.source_bytes, fetched.cache_bytes, self.counter.opens - before


def measure_storage_read(spec: dict) -> Dict[str, float]:
    """One epoch's reads of spec["data"] by spec["workers"] data-loading workers,
    timed from the first batch on (the workers' start-up left out): images/s,
    MB/s of image bytes, files opened per second, and the source's and the
    cache's bytes."""
    import torch

    os.environ.update(spec.get("environment", {}))  # the object store's credentials: this process only
    with OpenCounter([spec["data"] if "://" not in spec["data"] else "", spec.get("cache")]) as counter:
        reads = StorageReads(spec, counter)
        loader = torch.utils.data.DataLoader(reads, batch_size=spec["batch_size"],
                                             sampler=reads.order(spec["order"], spec["batch_size"]),
                                             num_workers=spec["workers"], collate_fn=_summed)
        totals, started, batches = [0, 0, 0, 0, 0], None, 0  # images, image bytes, source, cache, opens
        for batches, summed in enumerate(loader):
            if started is None:
                started = time.perf_counter()
                continue
            totals = [total + value for total, value in zip(totals, summed)]
        seconds = time.perf_counter() - started
    return {"images_per_second": totals[0] / seconds, "ms_per_step": 1000.0 * seconds / max(batches, 1),
            "mb_per_second": totals[1] / seconds / 1e6, "opens_per_second": totals[4] / seconds,
            "source_mb": totals[2] / 1e6, "cache_mb": totals[3] / 1e6, "peak_memory_mib": _peak_memory_mib("cpu")}


def _summed(items):
    """A batch's reads summed: (images, image bytes, source bytes, cache bytes, files opened)."""
    return (len(items), *(sum(column) for column in zip(*items)))


# --- the project's input pipeline, timed alone; the dispatch of a --child ---

def measure_input(backend: str, root: str, image_size: int, batch_size: int, workers: int, batches: int,
                  device: str) -> Dict[str, float]:
    """Batches per second of training crops, finished on the device as the
    end-to-end configuration takes them (channels-last: imagenet_nd.py's
    default on the CPU, the AMP configuration's on a GPU; the reference's
    float NCHW batches only move; dali's fed ahead, DaliDecoder.ahead),
    after one warm-up batch."""
    import torch

    from common import cli, data, distributed
    from common.device_input import DeviceInput

    dali = None  # --data-backend dali's decoder, which finishes its batches on the device
    if backend == "reference":
        loader = reference_input(root, image_size, batch_size, workers)
    else:
        cfg = cli.parse("nd", [root, "-b", str(batch_size), "-j", str(workers), "--image-size", str(image_size),
                               "--data-backend", backend, "--device", device])
        loaders = data.build_loaders(cfg, distributed.single_process(device))
        loaders.set_epoch(0)
        loader, dali = loaders.train, loaders.dali
    finish = DeviceInput(torch.device(device), channels_last=backend != "reference")
    images, started = 0, None
    if dali is not None:  # DALI decodes the next batch while this one is finished, as training feeds it
        loader = dali.ahead(loader)
    for index, batch in enumerate(loader):
        if backend == "reference":  # (images, target) pairs
            batch = data.Sample(*batch, file_bytes=0)
        finished = finish.batch(batch, dali)
        if index == 0:
            _synchronize(device)
            started = time.perf_counter()
        else:
            images += len(finished.target)
        if index == batches:
            break
    _synchronize(device)
    seconds = time.perf_counter() - started
    return {"images_per_second": images / seconds, "images_per_second_per_worker": images / seconds / max(workers, 1),
            "ms_per_step": 1000.0 * seconds / max(index, 1), "peak_memory_mib": _peak_memory_mib(device)}


# --- the decode section: DALI's decoders alone ---

def measure_decode(spec: dict) -> dict:
    """DALI's decode alone, no training: spec["batch_size"] JPEGs of
    spec["root"]/train (a fixed set, read once) decoded spec["batches"] times
    after spec["warmup"], by each (pipeline, hw_decoder_load) of
    spec["configs"] in turn: "whole" files (fn.decoders.image), or the
    training "crops" (common.dali's own pipeline: each file's crop box as the
    workers draw it, decoded, resized and flipped). Device "mixed" on a GPU,
    "cpu" on the CPU; fed common.dali.AHEAD_BATCHES ahead as training feeds
    it, the device synchronised at both ends. {"configs": [figures, ...]}."""
    import torch

    from common import dali
    from common.device_input import EncodedBatch
    from common.pipelines import DaliImages

    device, nvidia_dali = torch.device(spec["device"]), dali.import_dali()
    paths = sorted(str(path) for path in Path(spec["root"], "train").rglob("*")
                   if path.suffix.lower() in (".jpeg", ".jpg"))[:spec["batch_size"]]
    torch.manual_seed(0)  # the crop boxes and flips, drawn as a worker draws them
    crops = DaliImages(True, spec["image_size"])
    batch = EncodedBatch([crops(path)[0] for path in paths])
    files = [array.numpy() for array in torch.split(batch.data, batch.lengths)]
    measured = []
    for pipeline_name, load in spec["configs"]:
        if pipeline_name == "whole":
            pipeline = _whole_file_decoder(nvidia_dali, device, len(files), spec["threads"], load)
            feed = functools.partial(pipeline.feed_input, "files", files)
        else:
            pipeline = dali.build_pipeline(nvidia_dali, device, len(files), spec["threads"], False, load)
            feed = functools.partial(dali.feed_pipeline, pipeline, batch)
        _decoded(pipeline, feed, spec["warmup"], dali.AHEAD_BATCHES, spec["device"])
        started = time.perf_counter()
        _decoded(pipeline, feed, spec["batches"], dali.AHEAD_BATCHES, spec["device"])
        seconds = time.perf_counter() - started
        measured.append({"images_per_second": len(files) * spec["batches"] / seconds,
                         "ms_per_step": 1000.0 * seconds / spec["batches"], "peak_memory_mib": _peak_memory_mib(
                             spec["device"])})
        del pipeline, feed  # its threads and buffers, before the next one's
    return {"configs": measured, "images": len(files)}


def _whole_file_decoder(nvidia_dali, device, batch_size: int, threads: int, hw_decoder_load):
    fn, types = importlib.import_module("nvidia.dali.fn"), importlib.import_module("nvidia.dali.types")
    on_gpu = device.type == "cuda"
    pipeline = nvidia_dali.Pipeline(batch_size=batch_size, num_threads=threads, prefetch_queue_depth=1,
                                    device_id=(device.index or 0) if on_gpu else None, exec_dynamic=True)
    options = {"hw_decoder_load": hw_decoder_load} if on_gpu and hw_decoder_load is not None else {}
    with pipeline:
        files = fn.external_source(name="files", dtype=types.UINT8, ndim=1)
        pipeline.set_outputs(fn.decoders.image(files, device="mixed" if on_gpu else "cpu", output_type=types.RGB,
                                               **options))
    pipeline.build()
    return pipeline


def _decoded(pipeline, feed, batches: int, ahead: int, device: str) -> None:
    """`batches` runs of `pipeline`, each fed by `feed()`, `ahead` in flight, the outputs taken in turn."""
    scheduled = 0
    for taken in range(batches):
        while scheduled < min(batches, taken + ahead):
            feed()
            pipeline.schedule_run()
            scheduled += 1
        pipeline.outputs()
    _synchronize(device)


def child(spec: dict) -> dict:
    """The measurement `spec` asks for, in this process (for comm and scaling:
    in spec["world_size"] processes it starts, comm_bench)."""
    if spec["kind"] in ("comm", "scaling"):
        from common import cli
        from common.ports import free_port
        from common.tools.bench import comm_bench

        spec = dict(spec, init_method=f"tcp://127.0.0.1:{free_port()}")
        if spec["kind"] == "comm":
            return {"sizes": comm_bench.spawned("comm", spec)}
        flags = ["--synthetic", "-a", spec["arch"], "-b", str(spec["batch_size"]), "--image-size",
                 str(spec["image_size"]), "--ddp-comm-hook", spec["hook"]]
        if spec["hook"] == "powersgd":  # compressing from the second step: within the measured ones
            flags += ["--powersgd-start-step", str(SCALING_POWERSGD_START_STEP)]
        return comm_bench.spawned("scaling", spec, cli.parse("ddp", flags))
    if spec["kind"] == "storage-read":
        return measure_storage_read(spec)
    if spec["kind"] == "decode":
        return measure_decode(spec)
    if spec["kind"] == "reference-train":
        return reference_train_loop(spec["arch"], spec["batch_size"], spec["image_size"], spec["device"],
                                    spec["warmup_steps"], spec["steps"])
    return measure_input(spec["backend"], spec["root"], spec["image_size"], spec["batch_size"], spec["workers"],
                         spec["batches"], spec["device"])
