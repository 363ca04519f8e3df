"""What ci/public_api.py and ci/raw_inputs.py share: a crate's rustdoc JSON (nightly), and a
checked-in list written, checked against the code, or printed as the command line asks."""

import difflib
import json
import os
import subprocess
import sys

root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root_dir, "target"))


def rustdoc_json(package, crate):
    """The rustdoc JSON of `package`'s library (crate name `crate`), built first."""
    subprocess.run(
        ["cargo", "+nightly", "rustdoc", "-q", "--locked", "-p", package, "--lib", "--",
         "-Z", "unstable-options", "--output-format", "json"],
        cwd=root_dir, check=True,
    )
    return json.load(open(os.path.join(target, "doc", f"{crate}.json")))


def kind_of(item):
    """An index item's kind (`function`, `struct`, `use`, ...)."""
    return next(iter(item["inner"]))


def write_or_check(relative, text, stale):
    """With --write, writes `text` to `relative` (from the repository root); with --check,
    prints the difference and exits with `stale` where the file differs; else prints `text`."""
    listed = os.path.join(root_dir, relative)
    if "--write" in sys.argv:
        open(listed, "w").write(text)
    elif "--check" in sys.argv:
        old = open(listed).read() if os.path.exists(listed) else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True),
                                                       text.splitlines(True), relative,
                                                       "the code"))
            sys.exit(stale)
    else:
        sys.stdout.write(text)
