"""A --file-list for a dataset folder: the images a training run would find
by scanning it, as text.

    python -m common.tools.filelist DATA OUT
        one "train/<class>/<file> LABEL" or "val/<class>/<file> LABEL" line
        per image, paths relative to DATA, in the order and with the class
        indices a run uses (the format of DALI's file reader, with DATA as its
        file_root). Train with it: imagenet_nd.py DATA --file-list OUT.

OUT is written under a temporary name and renamed when complete; an existing
OUT is never overwritten.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from common.arguments import Parser
from common.dataset_lists import scan_dataset, write_text_list
from common.errors import UsageError, run_main
from common.files import atomic_write


def build_parser() -> Parser:
    parser = Parser(prog="python -m common.tools.filelist", description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, metavar="DATA", help="the dataset folder, holding train/ and val/")
    parser.add_argument("out", type=Path, metavar="OUT", help="the list to write (a new file)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    for split in ("train", "val"):
        if not (args.data / split).is_dir():
            raise UsageError(f"DATA {args.data}: no {split}/ folder (expected {args.data / split}/<class>/<images>)")
    if args.out.exists() or args.out.is_symlink():
        raise UsageError(f"OUT {args.out}: exists; choose another name (nothing is overwritten)")
    if not args.out.parent.is_dir():
        raise UsageError(f"OUT {args.out}: no such folder {args.out.parent}")
    print(f"scanning {args.data} ...", flush=True)
    started = time.monotonic()
    lists = scan_dataset(args.data)
    for note in lists.notes:
        print(note)
    try:
        atomic_write(args.out, lambda handle: write_text_list(handle, lists))
    except OSError as error:
        raise UsageError(f"OUT {args.out}: cannot write it ({error.strerror or error})") from None
    print(f"{args.out}: {len(lists.train):,} training and {len(lists.val):,} validation images in "
          f"{len(lists.classes)} classes ({time.monotonic() - started:.1f} s)", file=sys.stdout)


if __name__ == "__main__":
    run_main(main)
