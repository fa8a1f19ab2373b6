"""``python -m attn.compat [--force] script.py args...`` (or ``-m module args...``): run a
program written for flash-attn, unedited, with attn's flash-attn shim installed.

The program sees ``sys.argv = [script.py, args...]`` and runs as ``__main__``, its folder
first on ``sys.path``, as with ``python script.py``. ``--force`` installs the shim even where
a real flash-attn is importable.
"""

from __future__ import annotations

import os
import runpy
import sys

from attn.compat import install_flash_attn

USAGE = "usage: python -m attn.compat [--force] (script.py | -m module) [args...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    force = False
    if argv and argv[0] == "--force":
        force, argv = True, argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__, file=sys.stderr)
        return 0 if argv else 2
    if not install_flash_attn(force=force):
        print("attn.compat: a real flash_attn is importable; running with it (pass --force to "
              "use attn's)", file=sys.stderr)
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = list(argv)  # the script first, as python script.py sees it
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
