# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""``python -m torchtitan_seq1f1b.upstream --torchtitan-src DIR [--output P] [--ufmt PATH]
[--hook-only]``.

``--output`` defaults to ``seq1f1b.patch``; ``--ufmt`` formats the new Python
files as torchtitan's pre-commit does (:mod:`.formatting`); ``--hook-only``
writes the core patch alone (``pipeline_llm``'s schedule hook, :mod:`.schedule_hook`).
"""

import argparse
import sys
from pathlib import Path

from torchtitan_seq1f1b.upstream.patch import build_hook_patch, build_patch
from torchtitan_seq1f1b.upstream.tree import SourceTree, UpstreamError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_seq1f1b.upstream",
        description="Write a patch that adds Seq1F1B to a torchtitan 0.3.x source tree "
        "as torchtitan/experiments/seq1f1b, after pipeline_llm's schedule hook where the "
        "tree lacks it (apply it with `git apply`).",
    )
    parser.add_argument(
        "--torchtitan-src", required=True, type=Path,
        help="directory holding torchtitan/ (git checkout, unpacked sdist or copied package)",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("seq1f1b.patch"), help="patch file to write"
    )
    parser.add_argument(
        "--ufmt", default=None,
        help="ufmt executable to format the experiment's Python files with, as torchtitan's "
        "pre-commit does (it pins ufmt 2.3.0, black 22.12.0, usort 1.0.5); default: as written",
    )
    parser.add_argument(
        "--hook-only", action="store_true",
        help="write only the torchtitan core patch: pipeline_llm's schedule_builder hook "
        "and its unit test (the full patch starts with it where the tree lacks it)",
    )
    args = parser.parse_args(argv)
    try:
        source = SourceTree(args.torchtitan_src)
        patch = build_hook_patch(source) if args.hook_only else build_patch(source, args.ufmt)
    except UpstreamError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if not patch:
        print(f"error: {args.torchtitan_src} has the schedule hook already", file=sys.stderr)
        return 1
    args.output.write_text(patch)
    print(
        f"wrote {args.output}: apply it in {args.torchtitan_src} with "
        f"`git apply {args.output.resolve()}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
