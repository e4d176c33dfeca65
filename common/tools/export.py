"""Weights people can ship: a run's model (or its --model-ema average) as a
file that plain torch, torchvision, timm or onnxruntime code loads, with a
JSON card beside it, checked against the checkpoint before it is written.

    python -m common.tools.export RUN_OR_CHECKPOINT --format safetensors|onnx|torchscript OUT
            [--checkpoint best|last|FILE] [--weights model|ema] [--check-inputs N] [--tolerance T]
        RUN_OR_CHECKPOINT: a run directory (its model_best.pth.tar by
        default; --checkpoint last: its newest readable checkpoint; or a file
        of it) or a checkpoint file. OUT: the file to write (a new one), and
        OUT.json, its card: architecture, classes in order, the validation
        crop, resize and normalisation, the recipe, the checkpoint's
        validation top-1/top-5, the code's commit, the file's sha256.

The weights only (no optimizer state), under the plain model's names (no
DDP `module.` nor torch.compile `_orig_mod.`), contiguous and channels-first,
in float32. Before anything is written, the exported model runs N seeded
inputs (safetensors: loaded into a fresh model; ONNX: through onnxruntime;
TorchScript: torch.jit.load) and its logits must equal the checkpoint's
model's within T x max(1, the largest logit); else exit 1 and nothing is
written. Each format's package (requirements-export.txt) is imported only
when chosen. docs/outputs.md ("Weights to ship") says how each file loads.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import hashlib
import importlib
import importlib.metadata
import io
import json
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torchvision
from torch import nn

from common import checkpoint, models
from common.architectures import TIMM_PREFIX, check_architecture, is_timm
from common.arguments import Parser, int_at_least, positive_float
from common.config import RECIPE_OPTIONS
from common.errors import ReportedError, UsageError, error_summary, run_main
from common.files import atomic_write, read_whole_rows
from common.pipelines import IMAGENET_MEAN, IMAGENET_STD
from common.rundir import BEST_NAME, CHECKPOINT_NAME

FORMATS = ("safetensors", "onnx", "torchscript")
REQUIREMENTS = "requirements-export.txt"
# The modules each format needs, by package (TorchScript is torch's own); onnxscript is what torch.onnx.export
# writes ONNX with.
FORMAT_PACKAGES = {"safetensors": {"safetensors": "safetensors.torch"},
                   "onnx": {"onnx": "onnx", "onnxruntime": "onnxruntime", "onnxscript": "onnxscript"},
                   "torchscript": {}}
CARD_SUFFIX = ".json"  # the card is OUT + .json: beside OUT, sorted next to it, OUT's own extension kept
SOURCE = "RUN_OR_CHECKPOINT"
INPUT_NAME, OUTPUT_NAME = "images", "logits"  # the ONNX graph's names
EXAMPLE_BATCH = 2  # the batch ONNX and TorchScript are traced with; the check runs another (dynamic batch)
CHECK_SEED = 0
ONNX_LIMIT_BYTES = 2 << 30  # protobuf's limit on one ONNX file (larger needs external data files)


class ExportMismatch(ReportedError):
    """The exported model's outputs differ from the checkpoint's model's
    beyond the tolerance: exit status 1 (a bug of an exporter), nothing written."""


def build_parser() -> Parser:
    parser = Parser(prog="python -m common.tools.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, metavar=SOURCE,
                        help="a run directory, or a checkpoint file (.pth.tar) of one")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="safetensors (the weights, for a model built by torchvision/timm), onnx (a graph "
                             "for onnxruntime), torchscript (a graph for torch.jit.load); onnx and safetensors "
                             f"need {REQUIREMENTS}")
    parser.add_argument("out", type=Path, metavar="OUT", help="the file to write (a new one); its card is OUT.json")
    parser.add_argument("--checkpoint", metavar="best|last|FILE",
                        help="with a run directory: best (model_best.pth.tar, the default), last (its newest "
                             "readable checkpoint) or a checkpoint file of it")
    parser.add_argument("--weights", choices=("model", "ema"), default="model",
                        help="the model's weights (default) or its --model-ema average's")
    parser.add_argument("--check-inputs", type=int_at_least(1, "an integer from 1 to 64", 64), default=4,
                        metavar="N", help="seeded random images the exported model must answer alike (default 4)")
    parser.add_argument("--tolerance", type=positive_float, default=1e-4, metavar="T",
                        help="the largest difference of a logit allowed, times max(1, the largest logit) "
                             "(default 1e-4)")
    return parser


def checkpoint_path(source: Path, choice: Optional[str]) -> Path:
    """The checkpoint file RUN_OR_CHECKPOINT and --checkpoint name."""
    if not source.exists():
        raise UsageError(f"{SOURCE} {source}: no such file or directory")
    if not source.is_dir():
        if choice is not None:
            raise UsageError(f"argument --checkpoint: only with a run directory ({SOURCE} {source} is a file)")
        return source
    if choice in (None, "best"):
        if not (source / BEST_NAME).is_file():
            raise UsageError(f"{SOURCE} {source}: no {BEST_NAME} (no validated epoch, or not a run directory); "
                             f"--checkpoint last exports its newest checkpoint")
        return source / BEST_NAME
    if choice == "last":
        path, unreadable = checkpoint.newest_readable(source)
        for line in unreadable:
            print(f"warning: {line}", file=sys.stderr)
        if path is None:
            raise UsageError(f"{SOURCE} {source}: no readable checkpoint ({CHECKPOINT_NAME} or "
                             f"checkpoint-epoch*.pth.tar) in it")
        return path
    path = source / choice if (source / choice).is_file() else Path(choice)
    if not path.is_file():
        raise UsageError(f"argument --checkpoint: {choice} is neither best, last nor a file in {source}")
    return path


def check_out(out: Path) -> Path:
    """OUT's card path, after checking that neither file exists and OUT's folder does."""
    card = out.with_name(out.name + CARD_SUFFIX)
    for path in (out, card):
        if path.exists() or path.is_symlink():
            raise UsageError(f"OUT {out}: {path} exists; choose another name (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UsageError(f"OUT {out}: no such folder {out.parent}")
    return card


def import_packages(format_name: str) -> Dict[str, object]:
    """The format's packages, imported now (only the chosen format's); a
    missing one is one line naming the requirements file."""
    imported, missing = {}, []
    for package, module in FORMAT_PACKAGES[format_name].items():
        try:
            imported[package] = importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise UsageError(f"argument --format: {format_name} needs {', '.join(FORMAT_PACKAGES[format_name])} "
                         f"(missing: {', '.join(missing)}): pip install -r {REQUIREMENTS}")
    return imported


@dataclasses.dataclass(frozen=True)
class Exported:
    """What is exported: a checkpoint's chosen weights and the facts the card needs."""

    path: Path  # the checkpoint file
    state: dict  # what it holds (checkpoint.load)
    weights: str  # "model" or "ema"
    chosen: Dict[str, torch.Tensor]  # the chosen weights and buffers, as the checkpoint holds them

    @property
    def options(self) -> dict:
        return self.state["config"]

    @property
    def crop_px(self) -> int:
        return self.options.get("val_crop_size") or self.options["image_size"]

    def build(self) -> nn.Module:
        """A fresh model of the checkpoint's architecture (models.build_model,
        --blurpool included), in evaluation mode, not yet loaded."""
        options = self.options
        return models.build_model(self.state["arch"], len(self.state["classes"]), image_size=options["image_size"],
                                  dropout=options.get("dropout"), other_sizes=[("--val-crop-size", self.crop_px)],
                                  blurpool=bool(options.get("blurpool"))).eval()


def read_checkpoint(path: Path, weights: str) -> Exported:
    """The checkpoint through checkpoint.load (the safe loader), and the
    weights to export: the model's or --model-ema's average."""
    state = checkpoint.load(str(path), flag=SOURCE)
    if not state.get("classes") or not isinstance(state.get("config"), dict) or "arch" not in state:
        raise UsageError(f"argument {SOURCE}: {path} holds no class names, options or architecture (a checkpoint "
                         f"of another trainer?); export reads them from this project's checkpoints")
    try:  # this installation builds the model: its zoo has the name (timm is installed for a timm/ one)
        check_architecture(state["arch"])
    except UsageError as error:  # the line names -a/--arch, which export lacks
        raise UsageError(f"argument {SOURCE}: {path} holds a {state['arch']} model: "
                         f"{str(error).removeprefix('argument -a/--arch: ')}") from None
    if weights == "ema" and not state.get("model_ema"):
        raise UsageError(f"argument --weights: {path} holds no --model-ema average; export --weights model")
    return Exported(path, state, weights, state["model_ema"]["state_dict"] if weights == "ema" else state["state_dict"])


def loaded_model(exported: Exported) -> nn.Module:
    """The checkpoint's model with the chosen weights (their wrappers' name prefixes dropped by
    checkpoint.load_model_weights), in float32: the reference the export is checked against."""
    model = exported.build()
    checkpoint.load_model_weights({**exported.state, "state_dict": exported.chosen}, model,
                                  exported.state["arch"], exported.state["classes"], SOURCE, str(exported.path))
    return model


def plain_weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's weights and buffers under its own (plain) names: contiguous, so channels-first whatever the
    run's --memory-format; cloned, so no two names share storage (safetensors refuses that)."""
    return {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()}


def seeded_images(count: int, crop_px: int) -> torch.Tensor:
    """`count` random RGB images in [0, 1], normalised as validation normalises them."""
    generator = torch.Generator().manual_seed(CHECK_SEED)
    pixels = torch.rand(count, 3, crop_px, crop_px, generator=generator)
    mean, std = (torch.tensor(values).reshape(1, 3, 1, 1) for values in (IMAGENET_MEAN, IMAGENET_STD))
    return (pixels - mean) / std


@contextlib.contextmanager
def quiet_exporters():
    """torch.jit's deprecation notes and the ONNX exporter's advice, meant for
    library authors, kept off the user's terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def safetensors_bytes(exported: Exported, model: nn.Module, packages: dict) -> Tuple[bytes, dict]:
    metadata = {"format": "pt", "architecture": exported.state["arch"], "weights": exported.weights,
                "num_classes": str(len(exported.state["classes"]))}
    return packages["safetensors"].save(plain_weights(model), metadata=metadata), {}


def torchscript_bytes(exported: Exported, model: nn.Module, packages: dict) -> Tuple[bytes, dict]:
    buffer = io.BytesIO()
    try:
        with quiet_exporters(), torch.no_grad():
            torch.jit.save(torch.jit.trace(model, seeded_images(EXAMPLE_BATCH, exported.crop_px), check_trace=False),
                           buffer)
    except Exception as error:  # an operation tracing cannot record
        raise UsageError(f"argument --format: torch.jit.trace cannot trace {exported.state['arch']} "
                         f"({error_summary(error)}); try --format onnx or safetensors") from None
    return buffer.getvalue(), {}


def onnx_bytes(exported: Exported, model: nn.Module, packages: dict) -> Tuple[bytes, dict]:
    weight_bytes = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    if weight_bytes >= ONNX_LIMIT_BYTES:
        raise UsageError(f"argument --format: onnx holds at most 2 GiB in one file, {exported.state['arch']}'s "
                         f"weights take {weight_bytes / 2**30:.1f} GiB; use safetensors or torchscript")
    example = seeded_images(EXAMPLE_BATCH, exported.crop_px)
    try:
        with quiet_exporters(), torch.no_grad():
            program = torch.onnx.export(model, (example,), dynamo=True, verbose=False,
                                        input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                                        dynamic_shapes=({0: torch.export.Dim("batch")},))
            proto = program.model_proto
    except Exception as error:  # an operation the exporter has no ONNX for
        raise UsageError(f"argument --format: torch.onnx.export cannot export {exported.state['arch']} "
                         f"({error_summary(error)}); try --format torchscript or safetensors") from None
    opset = next((entry.version for entry in proto.opset_import if entry.domain in ("", "ai.onnx")), None)
    return proto.SerializeToString(), {"opset": opset}


WRITERS: Dict[str, Callable[[Exported, nn.Module, dict], Tuple[bytes, dict]]] = {
    "safetensors": safetensors_bytes, "onnx": onnx_bytes, "torchscript": torchscript_bytes}


def exported_outputs(format_name: str, data: bytes, exported: Exported, images: torch.Tensor,
                     packages: dict) -> Tuple[torch.Tensor, str]:
    """The exported file's logits for `images`, read back as its users read
    it, and what ran it."""
    if format_name == "onnx":
        runtime = packages["onnxruntime"]
        session = runtime.InferenceSession(data, providers=["CPUExecutionProvider"])
        logits = session.run([OUTPUT_NAME], {INPUT_NAME: images.numpy()})[0]
        return torch.from_numpy(logits), f"onnxruntime {runtime.__version__}"
    with torch.no_grad():
        if format_name == "torchscript":
            with quiet_exporters():
                return torch.jit.load(io.BytesIO(data), map_location="cpu").eval()(images), "torch.jit.load"
        fresh = exported.build()
        fresh.load_state_dict(packages["safetensors"].load(data), strict=True)
        return fresh(images), "a fresh model loaded from the safetensors"


def compared(outputs: torch.Tensor, reference: torch.Tensor, tolerance: float, by: str) -> dict:
    """The check's record; ExportMismatch when the outputs differ by more
    than `tolerance` x max(1, the largest reference logit)."""
    if outputs.shape != reference.shape:
        raise ExportMismatch(f"the exported model's outputs have shape {tuple(outputs.shape)}, the checkpoint's "
                             f"{tuple(reference.shape)} ({by}); nothing written")
    difference = (outputs.double() - reference.double()).abs().max().item()
    allowed = tolerance * max(1.0, reference.abs().max().item())
    if not difference <= allowed:  # NaN too
        raise ExportMismatch(f"the exported model's logits differ from the checkpoint's by up to {difference:.3g} "
                             f"({by}), above the {allowed:.3g} allowed (--tolerance {tolerance:g} x max(1, the "
                             f"largest logit)); nothing written")
    return {"inputs": reference.shape[0], "seed": CHECK_SEED, "by": by, "max_abs_difference": difference,
            "allowed": allowed, "tolerance": tolerance}


def validation(exported: Exported) -> dict:
    """Validation top-1/top-5 of the exported weights: the metrics.csv row
    beside the checkpoint of the epoch it ended (`val`, or `val_ema` for
    the average), else the checkpoint's own best_acc1 when it is that
    epoch's; None for weights never validated (a checkpoint within an epoch)."""
    state, split = exported.state, "val_ema" if exported.weights == "ema" else "val"
    figures = {"top1": None, "top5": None, "epoch": None, "split": split, "from": None}
    if state.get("step") or state.get("images_done") or not state.get("epoch"):
        return {**figures, "note": "a checkpoint within an epoch: these weights were not validated"}
    epoch = state["epoch"] - 1  # a checkpoint at an epoch's end is the next epoch's start
    metrics = exported.path.parent / "metrics.csv"
    try:
        read = read_whole_rows(metrics)
        if read.warning():  # rows a crash cut short, as the other tools that read metrics.csv say
            print(read.warning(), file=sys.stderr)
        rows = [row for row in read.rows if (row.get("epoch"), row.get("split")) == (str(epoch), split)]
        if rows:
            return {**figures, "top1": float(rows[-1]["top1"]), "top5": float(rows[-1]["top5"]), "epoch": epoch,
                    "from": "metrics.csv"}
    except (OSError, ValueError, csv.Error):  # no metrics.csv beside it (a copied checkpoint), or not one
        pass
    if state.get("best_epoch") == epoch and (state.get("best_source") or "model") == exported.weights:
        return {**figures, "top1": state["best_acc1"], "epoch": epoch, "from": "the checkpoint's best_acc1"}
    return {**figures, "epoch": epoch, "note": f"no {split} row of epoch {epoch} in a metrics.csv beside the "
                                               f"checkpoint"}


def run_records(run_dir: Path) -> List[Tuple[str, dict]]:
    """config.json and each line of resumes.jsonl of a run directory, named; those that cannot be read left out."""
    records = []
    try:
        records.append(("config.json", json.loads((run_dir / "config.json").read_text())))
        lines = (run_dir / "resumes.jsonl").read_text().splitlines() if (run_dir / "resumes.jsonl").is_file() else []
    except (OSError, ValueError):
        return records
    for number, line in enumerate(lines, 1):
        try:
            records.append((f"resumes.jsonl line {number}", json.loads(line)))
        except ValueError:  # a line a crash cut short
            continue
    return [(name, record) for name, record in records if isinstance(record, dict)]


def code_and_command(exported: Exported) -> dict:
    """The code that wrote the checkpoint (common.provenance's fields, as the
    run recorded them: config.json, or the resume's line of resumes.jsonl
    that was running at its position), the command and the recipe record."""
    records = run_records(exported.path.parent)
    position = (exported.state.get("epoch", 0), exported.state.get("step", 0))
    started_before = [(name, record) for name, record in records
                      if (record.get("start_epoch") or 0, record.get("start_step") or 0) < position]
    name, record = (started_before or records or [(None, {})])[-1]
    environment = record.get("environment") or {}
    first = records[0][1] if records else {}
    return {"code": {"git_commit": environment.get("git_commit"), "git_dirty": environment.get("git_dirty"),
                     "git_diff_sha256": environment.get("git_diff_sha256"), "recorded_in": name},
            "command": first.get("command"), "recipe_record": first.get("recipe")}


def loading_code(format_name: str, exported: Exported) -> str:
    """How plain code loads the file (FILE its path, `images` a float32 N x 3 x crop x crop batch)."""
    if format_name == "onnx":
        return f"onnxruntime.InferenceSession(FILE).run(['{OUTPUT_NAME}'], {{'{INPUT_NAME}': images}})[0]"
    if format_name == "torchscript":
        return "torch.jit.load(FILE).eval()(images)"
    arch, classes, options = exported.state["arch"], len(exported.state["classes"]), exported.options
    # The input size the model was built for (a ViT's position embedding has its shape), as build() builds it.
    sizes = models.input_size_kwargs(arch, options["image_size"])
    extra = "".join(f", {name}={value!r}" for name, value in sizes.items())
    if is_timm(arch):
        builder = f"timm.create_model({arch[len(TIMM_PREFIX):]!r}, num_classes={classes}{extra})"
    else:
        builder = f"torchvision.models.get_model({arch!r}, num_classes={classes}{extra})"
    code = f"model = {builder}; model.load_state_dict(safetensors.torch.load_file(FILE)); model.eval()"
    if options.get("blurpool"):
        code += ("  # into a model with FFCV's BlurPool first: each strided convolution of 16 or more input "
                 "channels becomes Sequential(blur, convolution), its weights <name>.1.weight (this project's "
                 "common.models.add_blurpool); ONNX and TorchScript files hold the blur themselves")
    return code


def make_card(format_name: str, out: Path, data: bytes, exported: Exported, check: dict, details: dict,
              packages: dict) -> dict:
    state, options = exported.state, exported.options
    provenance = code_and_command(exported)
    # timm's too for its models: their module names, which the weights' names follow, are its version's.
    timm_version = {"timm": importlib.metadata.version("timm")} if is_timm(state["arch"]) else {}
    versions = {"torch": torch.__version__, "torchvision": torchvision.__version__, **timm_version,
                **{name: getattr(module, "__version__", None) for name, module in packages.items()}}
    return {
        "format": format_name, "file": out.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
        **details,
        "architecture": state["arch"], "weights": exported.weights,
        "num_classes": len(state["classes"]), "classes": list(state["classes"]),
        "input": {"crop_px": exported.crop_px, "resize_px": options.get("val_resize"),
                  "preprocess": "resize the shorter side to resize_px (bilinear, antialiased), centre-crop crop_px, "
                                "RGB scaled to [0, 1], then (x - mean) / std per channel",
                  "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "layout": "N x 3 x H x W, float32",
                  "test_time_flip": bool(options.get("val_flip"))},
        "output": "logits, one per class in the order of classes (no softmax)",
        "blurpool": bool(options.get("blurpool")),
        "loads_with": loading_code(format_name, exported),
        "validation": validation(exported),
        "recipe": {"name": options.get("recipe"), "record": provenance["recipe_record"],
                   "options": {name: options[name] for name in RECIPE_OPTIONS if name in options}},
        "command": provenance["command"],
        "checkpoint": {"file": str(exported.path), **{key: state.get(key) for key in (
            "epoch", "step", "images_done", "best_acc1", "best_epoch", "best_source")}},
        "code": provenance["code"],
        "check": check,
        "versions": versions,
        "exported": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def write_files(out: Path, card_path: Path, data: bytes, card: dict) -> None:
    """OUT, then its card, each whole or not at all and never over an
    existing file; OUT removed again when its card cannot be written."""
    try:
        atomic_write(out, lambda handle: handle.write(data), overwrite=False)
    except FileExistsError:
        raise UsageError(f"OUT {out}: exists (made while exporting); nothing is overwritten") from None
    except OSError as error:
        raise UsageError(f"OUT {out}: cannot write it ({error.strerror or error})") from None
    try:
        atomic_write(card_path, lambda handle: handle.write((json.dumps(card, indent=2) + "\n").encode()),
                     overwrite=False)
    except OSError as error:
        out.unlink()
        raise UsageError(f"OUT {out}: cannot write its card {card_path} ({error.strerror or error}); "
                         f"{out} removed") from None


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    card_path = check_out(args.out)
    path = checkpoint_path(args.source, args.checkpoint)
    packages = import_packages(args.format)
    exported = read_checkpoint(path, args.weights)
    model = loaded_model(exported)
    images = seeded_images(args.check_inputs, exported.crop_px)
    with torch.no_grad():
        reference = model(images)
    data, details = WRITERS[args.format](exported, model, packages)
    outputs, by = exported_outputs(args.format, data, exported, images, packages)
    check = compared(outputs, reference, args.tolerance, by)
    card = make_card(args.format, args.out, data, exported, check, details, packages)
    write_files(args.out, card_path, data, card)
    figures = card["validation"]
    top1 = f"validation top-1 {figures['top1']:.2f}%" if figures["top1"] is not None else "not validated"
    whose = "--model-ema average's" if args.weights == "ema" else "model's"
    print(f"{args.out}: {exported.state['arch']}, the {whose} weights of {path} (epoch "
          f"{exported.state.get('epoch')}, {top1}) as {args.format}, {len(data):,} bytes, sha256 "
          f"{card['sha256'][:16]}...; card {card_path}")
    print(f"check: {check['inputs']} seeded {exported.crop_px}-pixel images through {by}: max abs difference "
          f"{check['max_abs_difference']:.3g}, allowed {check['allowed']:.3g}")
    if args.weights == "model" and state_best_is_ema(exported):
        print("note: this checkpoint's best top-1 was its --model-ema average's: --weights ema exports it")


def state_best_is_ema(exported: Exported) -> bool:
    return exported.state.get("best_source") == "ema" and bool(exported.state.get("model_ema"))


if __name__ == "__main__":
    run_main(main)
