"""The command line of every entry script, parsed (the parser and its flags:
common/flags.py) and checked across flags, and the wrapper that turns a
user's mistake into one line and exit status 2.

`parse(mode, argv)` returns a frozen `Config`: every option resolved and
checked, nothing left for later code to second-guess. Flags keep the
spellings users know from the ImageNet reference scripts (pytorch/examples).

Importing this module, --help and every mistake but one import no torch
(seconds and hundreds of MiB): the architecture names come from
common.architectures' cache, the choices from common.config, and `run`'s
launcher reading from common.launcher. The one exception is -b 1 in
training, checked last by running the model on the meta device.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from common import launcher, process_signals, recipes
from common.architectures import check_architecture, is_timm
from common.arguments import check_batch_fits, check_fits_in_memory, did_you_mean, memory_bytes
from common.config import MODES, OBJECT_STORE_SCHEMES, TRACKERS_REQUIREMENTS, Config, is_sharded, report_files
from common.errors import UsageError, error_summary, run_main
from common.flags import build_parser

__all__ = ["build_parser", "parse", "run"]


def parse(mode: str, argv: Optional[Sequence[str]] = None) -> Config:
    """Parse and check the command line of the `mode` entry script; with
    --recipe, over the recipe's flags (_apply_recipe)."""
    parser = build_parser(mode)
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    kept, overridden = {}, ()
    if ns.recipe is not None:
        ns, kept, overridden = _apply_recipe(parser, mode, ns.recipe, argv)
    try:
        _check_values(ns)
    except UsageError as error:
        raise _blamed_on_recipe(error, parser, ns.recipe, kept) from None
    # argparse destinations are the Config field names; a flag's several values (--lr-steps, --crop-scale,
    # --progressive-resizing) a tuple, not a list: the Config is frozen
    values = {dest: tuple(value) if isinstance(value, list) else value for dest, value in vars(ns).items()}
    values.pop("multiprocessing_distributed", None)  # a no-op kept for pytorch/examples command lines
    values["checkpoint_every_steps"], values["checkpoint_every_minutes"] = values.pop("checkpoint_every")
    values["trackers"] = tuple(dict.fromkeys(values["trackers"] or ()))  # each once, in the order given
    values["eval_sets"] = values["eval_sets"] or ()  # argparse's append: None when never given
    return Config(mode=mode, recipe_overridden=overridden, **values)


def _apply_recipe(parser: argparse.ArgumentParser, mode: str, name: str,
                  argv: List[str]) -> Tuple[argparse.Namespace, Dict[str, str], Tuple[str, ...]]:
    """The command line parsed over recipe `name`'s flags, as if they were
    typed before it: each of the recipe's flags is parsed in turn (so that a
    mistake names its key), then argv over them, so the command line's own
    flags win (argparse keeps the last value). Returns that namespace, the
    recipe's flags the command line left alone ({destination: key}) and the
    keys it overrode, in the file's order."""
    recipe = recipes.read(name)
    ns, keys = argparse.Namespace(), {}
    for key in recipe.flags:
        action = parser._option_string_actions.get(f"--{key}")
        if action is None or action.dest in ("recipe", "help"):
            raise recipe.mistake(key, _not_a_flag_of(mode, key, parser))
        if action.dest in keys:
            raise recipe.mistake(key, f"sets what {keys[action.dest]!r} already set")
        keys[action.dest] = key
        words = recipes.flag_words(recipe, key, switch=action.nargs == 0)
        try:
            ns = parser.parse_args(words, namespace=ns)
        except UsageError as error:
            raise recipe.mistake(key, str(error)) from None
        if ns.data is not None:  # a list longer than the flag takes: the rest would be read as DATA
            raise recipe.mistake(key, f"more values than --{key} takes")
    given = _given_destinations(parser, argv)
    ns = parser.parse_args(argv, namespace=ns)
    return (ns, {dest: key for dest, key in keys.items() if dest not in given},
            tuple(key for dest, key in keys.items() if dest in given))


_NOT_GIVEN = object()


def _given_destinations(parser: argparse.ArgumentParser, argv: List[str]) -> set:
    """The destinations that argv's own flags set, whatever their values:
    argv parsed over a namespace whose every destination is taken already,
    so that argparse fills in no default and what changed was given."""
    probe = argparse.Namespace(**{action.dest: _NOT_GIVEN for action in parser._actions})
    parser.parse_args(argv, namespace=probe)
    return {dest for dest, value in vars(probe).items() if value is not _NOT_GIVEN}


def _not_a_flag_of(mode: str, key: str, parser: argparse.ArgumentParser) -> str:
    """Why a recipe file's key is no flag of this script: another script's
    flag (--opt-level is imagenet_ddp_apex.py's), or a misspelt one."""
    if key in ("recipe", "help"):
        return f"--{key} cannot be set by a recipe"
    others = [f"imagenet_{other}.py" for other in MODES
              if other != mode and f"--{key}" in build_parser(other)._option_string_actions]
    longs = [option[2:] for option in parser._option_string_actions if option.startswith("--")]
    return (f"imagenet_{mode}.py has no flag --{key}" +
            (f"; run this recipe with {' or '.join(others)}" if others else did_you_mean(key, longs)))


_NAMED_FLAG = re.compile(r"argument (\S+):")


def _blamed_on_recipe(error: UsageError, parser: argparse.ArgumentParser, recipe: Optional[str],
                      kept: Dict[str, str]) -> UsageError:
    """A check across flags that failed on a value the recipe set and the
    command line left alone (its --warmup-epochs 5 against --epochs 2) says
    so, and how to override it."""
    named = _NAMED_FLAG.match(str(error))
    actions = parser._option_string_actions
    dests = [actions[flag].dest for flag in named.group(1).split("/") if flag in actions] if named else []
    blamed = next((kept[dest] for dest in dests if dest in kept), None)
    if blamed is None:
        return error
    return UsageError(f"{error} (--{blamed} was set by --recipe {recipe}: give it on the command line to override)")


def _check_values(ns: argparse.Namespace) -> None:
    """Checks across flags and on paths: each failure names its flag or path.
    The one check that needs torch comes last, so that every other mistake is
    reported without importing it."""
    check_architecture(ns.arch)
    _check_pretrained_file(ns.arch, ns.pretrained_file)
    _check_distributed_flags(ns)
    _check_training_flags(ns)
    if ns.cuda_graphs == "on" and getattr(ns, "device", "auto") == "cpu":  # a CPU picked by auto: common.cuda_graphs
        raise UsageError("argument --cuda-graphs: on needs a CUDA GPU, and --device cpu trains on the CPU "
                         "(use auto or off)")
    _check_augmentation_flags(ns)
    _check_machine_fits(ns)
    _check_output_paths(ns)
    _check_trackers(ns.trackers or (), ns.evaluate)
    _check_evaluation_flags(ns)
    if not ns.synthetic:
        _check_dataset(ns)
    if ns.batch_size == 1 and not ns.evaluate:
        # Runs the model on the meta device, so it imports torch and torchvision; only -b 1 pays for it.
        from common.models import check_one_image_per_step
        smallest = ns.progressive_resizing[0] if ns.progressive_resizing else ns.image_size  # the smallest crop
        check_one_image_per_step(ns.arch, smallest)


def _check_pretrained_file(arch: str, path: Optional[str]) -> None:
    if path is not None and not is_timm(arch):
        raise UsageError(f"argument --pretrained-file: only for timm/ models, not {arch} (torchvision's weights: "
                         f"--pretrained, from the torch hub cache)")
    if path is not None and not os.path.isfile(path):
        raise UsageError(f"argument --pretrained-file: {path} is not a file")


def _check_distributed_flags(ns: argparse.Namespace) -> None:
    """The flags of imagenet_ddp.py and imagenet_ddp_apex.py (absent from the other scripts' namespaces)."""
    if getattr(ns, "rank", None) is not None and ns.rank >= (ns.world_size or 1):
        raise UsageError(f"argument --rank: node rank {ns.rank} is not below --world-size {ns.world_size or 1} "
                         f"(ranks count from 0)")
    if getattr(ns, "dist_url", None) is not None and not ns.dist_url.startswith("tcp://"):
        raise UsageError(f"argument --dist-url: expected tcp://HOST:PORT of node 0, got {ns.dist_url!r} "
                         f"(under torchrun, launch or srun leave it unset)")
    if getattr(ns, "dist_url", None) is not None:
        launcher.tcp_address(ns.dist_url)  # its form, now: before anything quotes or records it
    hook = getattr(ns, "ddp_comm_hook", "none")
    for flag, value in (("--powersgd-rank", getattr(ns, "powersgd_rank", None)),
                        ("--powersgd-start-step", getattr(ns, "powersgd_start_step", None))):
        if value is not None and hook != "powersgd":
            raise UsageError(f"argument {flag}: only with --ddp-comm-hook powersgd (this run: {hook})")
    if getattr(ns, "static_graph", False) and ns.accum_steps > 1:
        # DDP's static graph expects every backward to exchange gradients; torch 2.14 fails an internal
        # assertion at the first no_sync() backward (pytorch/pytorch#187732).
        raise UsageError(f"argument --static-graph: not with --accum-steps {ns.accum_steps} (DDP's static graph "
                         f"cannot skip the exchange of the micro-batches before the last)")
    if (getattr(ns, "powersgd_start_step", None) or 2) < 2:
        raise UsageError("argument --powersgd-start-step: 1 is below 2 (DDP settles its buckets in the first "
                         "steps, before PowerSGD can keep state for them)")


def _check_training_flags(ns: argparse.Namespace) -> None:
    """Epochs, image sizes, crops and the schedule, against each other."""
    if ns.start_epoch >= ns.epochs:
        raise UsageError(f"argument --start-epoch: {ns.start_epoch} is not below --epochs {ns.epochs}")
    val_crop, crop_flag = (ns.val_crop_size, "--val-crop-size") if ns.val_crop_size else (ns.image_size, "--image-size")
    if ns.val_resize < val_crop:
        raise UsageError(f"argument --val-resize: {ns.val_resize} is smaller than {crop_flag} {val_crop}")
    _check_progressive_resizing(ns.progressive_resizing)
    if ns.crop_scale[0] > ns.crop_scale[1]:
        raise UsageError(f"argument --crop-scale: MIN {ns.crop_scale[0]:g} is above MAX {ns.crop_scale[1]:g}")
    if list(ns.lr_steps) != sorted(set(ns.lr_steps)):
        raise UsageError(f"argument --lr-steps: epochs must be increasing, got {' '.join(map(str, ns.lr_steps))}")
    if ns.warmup_epochs > ns.epochs:
        raise UsageError(f"argument --warmup-epochs: {ns.warmup_epochs:g} is more than --epochs {ns.epochs}")
    if ns.lr_min > ns.lr:
        raise UsageError(f"argument --lr-min: {ns.lr_min:g} is above --lr {ns.lr:g} (both per 256 images): the "
                         f"floor must not be above the peak")
    if ns.nesterov and ns.momentum == 0:
        raise UsageError("argument --nesterov: Nesterov momentum needs a --momentum above 0 (this run: 0)")


def _check_augmentation_flags(ns: argparse.Namespace) -> None:
    """--auto-augment and --random-erase against the backend; a policy's own setting without the policy."""
    for flag, value in (("--auto-augment", ns.auto_augment), ("--random-erase", ns.random_erase)):
        if value and ns.data_backend == "dali":
            raise UsageError(f"argument {flag}: not with --data-backend dali (its pipeline on the device does not "
                             f"apply it; use gpu, torchvision or pil)")
    defaults = {field.name: field.default for field in dataclasses.fields(Config)}
    for flag, name, policy in (("--ra-magnitude", "ra_magnitude", "ra"), ("--augmix-severity", "augmix_severity",
                                                                           "augmix")):
        if getattr(ns, name) != defaults[name] and ns.auto_augment != policy:
            raise UsageError(f"argument {flag}: only with --auto-augment {policy} (this run: "
                             f"{ns.auto_augment or 'none'})")
def _check_progressive_resizing(progressive: Optional[Sequence[int]]) -> None:
    """--progressive-resizing MIN_PX MAX_PX START_EPOCH END_EPOCH: sizes, and a range of epochs, in order."""
    if progressive is None:
        return
    min_px, max_px, start_epoch, end_epoch = progressive
    if min_px < 1:
        raise UsageError("argument --progressive-resizing: MIN_PX 0 is no size (a side of at least 1 pixel)")
    if min_px > max_px:
        raise UsageError(f"argument --progressive-resizing: MIN_PX {min_px} is above MAX_PX {max_px}")
    if start_epoch > end_epoch:
        raise UsageError(f"argument --progressive-resizing: START_EPOCH {start_epoch} is after END_EPOCH {end_epoch}")


def _check_machine_fits(ns: argparse.Namespace) -> None:
    """Sizes and counts this machine could never hold, told before anything
    is allocated or started (a value of 10**15 included): one image and one
    process's batch as the float32 input the model takes, a validation
    image resized to --val-resize, the node's processes (launcher)."""
    memory = memory_bytes()
    check_batch_fits(ns.batch_size, ns.image_size, memory)
    if ns.progressive_resizing is not None:  # its largest crop; MIN_PX is no larger
        check_batch_fits(ns.batch_size, ns.progressive_resizing[1], memory, size_flag="--progressive-resizing")
    check_fits_in_memory("--val-resize", 3 * ns.val_resize ** 2,
                         f"one validation image resized to {ns.val_resize}x{ns.val_resize} pixels", memory)
    if ns.val_crop_size is not None:  # no larger than --val-resize (checked before)
        check_batch_fits(ns.batch_size, ns.val_crop_size, memory, size_flag="--val-crop-size")
    # The flags' process count; the launcher checks the real one (GPUs, torchrun's) again before starting.
    launcher.check_node_processes(getattr(ns, "nproc_per_node", None) or 1, ns.workers, ns.batch_size,
                                  ns.image_size, share_cores=ns.device == "cpu", memory=memory)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _check_output_paths(ns: argparse.Namespace) -> None:
    """--run-name, --resume and --report-dir: names and files a run reads or must not overwrite."""
    for flag, value in (("DATA", ns.data), ("--logdir", ns.logdir), ("--resume", ns.resume),
                        ("--file-list", ns.file_list), ("--report-dir", ns.report_dir)):
        # Taken for a path, s3://KEY:SECRET@bucket would become local folders named after the secret.
        if value is not None and _URL.match(value) and not (flag == "DATA" and value.startswith(OBJECT_STORE_SCHEMES)):
            where = flag if flag == "DATA" else f"argument {flag}"
            raise UsageError(f"{where}: {value!r} is a URL; give a path on a local or mounted file system")
    if ns.run_name is not None and (not ns.run_name or os.sep in ns.run_name or ns.run_name in (".", "..")):
        raise UsageError(f"argument --run-name: {ns.run_name!r} must be a plain folder name")
    if ns.resume is not None and ns.resume != "auto":
        resume = Path(ns.resume)
        if _is(resume, Path.is_dir, "--resume"):
            newest = resume / "checkpoint.pth.tar"  # what a run directory's newest checkpoint is called
            give = (f"give a file in it (its newest: {newest})" if _is(newest, Path.is_file, "--resume") else
                    f"give a checkpoint file (it holds no {newest.name}, a run directory's newest)")
            raise UsageError(f"argument --resume: {resume} is a directory, not a checkpoint file; {give}, or --resume "
                             f"auto --logdir {resume.parent} --run-name {resume.name} to continue the run there")
        if not _is(resume, Path.is_file, "--resume"):
            raise UsageError(f"argument --resume: no such checkpoint file: {resume}")
        if not os.access(resume, os.R_OK):
            raise UsageError(f"argument --resume: cannot read {resume} (permission denied)")
    if ns.report_dir is not None:
        if not ns.evaluate:
            raise UsageError("argument --report-dir: only with --evaluate (training writes its per-class report "
                             "into the run directory)")
        for name in report_files([name for name, _ in ns.eval_sets or ()]):
            if _is(Path(ns.report_dir) / name, Path.exists, "--report-dir"):
                raise UsageError(f"argument --report-dir: {Path(ns.report_dir) / name} exists; "
                                 f"choose another folder (nothing is overwritten)")


def _check_evaluation_flags(ns: argparse.Namespace) -> None:
    """--eval-set and --real-labels: only with --evaluate of real images; the sets' folders and the labels' file."""
    for flag, given in (("--eval-set", ns.eval_sets), ("--real-labels", ns.real_labels)):
        if given and not ns.evaluate:
            raise UsageError(f"argument {flag}: only with --evaluate (training validates DATA's val/ only)")
        if given and ns.synthetic:
            raise UsageError(f"argument {flag}: not with --synthetic (its random images have no labels to score)")
    names = [name for name, _ in ns.eval_sets or ()]
    for name, folder in ns.eval_sets or ():
        if names.count(name) > 1:
            raise UsageError(f"argument --eval-set: NAME {name} is given twice; each set needs its own name")
        if not _is(Path(folder), Path.is_dir, "--eval-set"):
            raise UsageError(f"argument --eval-set: {name}={folder}: no such directory (the set's folder, holding "
                             f"{folder}/<class>/<images>)")
    if ns.real_labels is not None and not _is(Path(ns.real_labels), Path.is_file, "--real-labels"):
        raise UsageError(f"argument --real-labels: no such file: {ns.real_labels} (ImageNet-ReaL's real.json)")


def _check_dataset(ns: argparse.Namespace) -> None:
    """DATA and --file-list, unless --synthetic."""
    if ns.data is None:
        raise UsageError("DATA: missing; give the dataset folder (holding train/ and val/), or use --synthetic")
    _check_shard_flags(ns)
    if is_sharded(ns.data):
        return  # its manifest and shards are checked by the primary before training (common.shards)
    root = Path(ns.data)
    if not _is(root, Path.is_dir, "DATA"):
        what = "not a directory" if _is(root, Path.exists, "DATA") else "no such directory"
        raise UsageError(f"DATA {root}: {what} (the dataset folder, holding train/ and val/)")
    for split in ("train", "val"):
        if not _is(root / split, Path.is_dir, "DATA"):
            raise UsageError(f"DATA {root}: no {split}/ folder (expected {root / split}/<class>/<images>)")
    if ns.file_list is not None and not _is(Path(ns.file_list), Path.is_file, "--file-list"):
        if _is(Path(ns.file_list), Path.is_dir, "--file-list"):
            raise UsageError(f"argument --file-list: {ns.file_list} is a directory; give the list file "
                             f"(python -m common.tools.filelist DATA PATH writes one)")
        raise UsageError(f"argument --file-list: no such file: {ns.file_list}")


def _check_shard_flags(ns: argparse.Namespace) -> None:
    """A sharded DATA's flags: each only with the DATA it is for; no credentials in a URL."""
    sharded, object_store = is_sharded(ns.data), ns.data.startswith(OBJECT_STORE_SCHEMES)
    if object_store and "@" in ns.data:  # no bucket name holds one; a secret may hold '/' too: the URL is not echoed
        raise UsageError("DATA: an s3:// URL with '@' in it (credentials?) is refused; give s3://bucket/prefix, with "
                         "credentials from the AWS environment or profile")
    if object_store and not ns.data.split("://", 1)[1].strip("/"):
        raise UsageError(f"DATA {ns.data}: no bucket; give s3://bucket/prefix")
    for flag, value, needed in (("--file-list", ns.file_list, not sharded), ("--data-cache", ns.data_cache, sharded),
                                ("--data-cache-size", ns.data_cache_bytes or None, ns.data_cache is not None),
                                ("--s3-endpoint-url", ns.s3_endpoint_url, object_store)):
        if value is not None and not needed:
            why = {"--file-list": "a sharded DATA lists its images in its manifest and index",
                   "--data-cache": "it caches shards; DATA is no sharded dataset (python -m common.tools.pack_shards "
                                   "DATA OUT makes one)",
                   "--data-cache-size": "it sizes --data-cache, not given",
                   "--s3-endpoint-url": "DATA is no s3:// URL"}[flag]
            raise UsageError(f"argument {flag}: not here: {why}")
    url = ns.s3_endpoint_url
    if url is not None and (not re.match(r"https?://[^/@\s]+(/|$)", url)):
        raise UsageError(f"argument --s3-endpoint-url: {url!r}: expected http(s)://HOST[:PORT], without "
                         f"credentials (those come from the AWS environment or profile)")
    if ns.data_cache is not None and _is(Path(ns.data_cache), Path.exists, "--data-cache") and \
            not _is(Path(ns.data_cache), Path.is_dir, "--data-cache"):
        raise UsageError(f"argument --data-cache: {ns.data_cache} is not a folder")




def _check_trackers(trackers: Sequence[str], evaluate: bool) -> None:
    """--tracker: a training run's, and its library installed (looked up, not imported: no seconds spent, and
    a missing one said before training starts)."""
    if trackers and evaluate:
        raise UsageError("argument --tracker: not with --evaluate (a tracker follows a training run; --report-dir "
                         "keeps an evaluation's report)")
    for name in trackers:
        if importlib.util.find_spec(name) is None:
            raise UsageError(f"argument --tracker: {name} is not installed: pip install -r {TRACKERS_REQUIREMENTS}")


def _is(path: Path, test: Callable[[Path], bool], flag: str) -> bool:
    """`test(path)` (is_file, is_dir, exists), where an OSError other than
    "no such file" (a name too long, a folder on the way that cannot be
    entered) is the user's to fix: a UsageError naming `flag` and the path."""
    try:
        return test(path)
    except OSError as error:
        where = f"argument {flag}" if flag.startswith("-") else flag
        raise UsageError(f"{where}: cannot look at {path} ({error.strerror or error_summary(error)})") from None


def run(main: Callable[[], object]) -> None:
    """Run an entry script's main(): a UsageError becomes one line on stderr
    and exit status 2, Ctrl-C exit status 130, neither with a traceback
    (errors.exit_status)."""
    process_signals.ignore_stop_signals_until_training()
    process_signals.dump_stacks_on_quit()
    run_main(main, *launcher.launched_identity())
