"""The user's program: where a command line's own options end, and running it as ``__main__``.

``python -m chief [OPTIONS] SCRIPT [ARGS]`` and ``psflow local [OPTIONS] SCRIPT
[ARGS]`` hand everything after ``SCRIPT`` to the script, options included, as
``python`` itself does; ``-m MODULE`` may stand in for ``SCRIPT``.
:func:`split_command` finds that boundary; :func:`run_target` runs the program
the way ``python SCRIPT`` / ``python -m MODULE`` would.

Example:
    >>> split_command(["--ps", "2", "train.py", "--epochs", "3"], {"--ps"})
    (['--ps', '2'], Target(path='train.py', module=None, args=('--epochs', '3')))
    >>> split_command(["-m", "pkg.train", "-v"], set())
    ([], Target(path=None, module='pkg.train', args=('-v',)))
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import sys
from collections.abc import Collection

from psflow.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Target:
    """The program to run: a script path or a module name, and its arguments."""

    path: str | None
    module: str | None
    args: tuple[str, ...] = ()

    @property
    def argv(self) -> list[str]:
        """How to name it on a ``python`` command line: ``[path]`` or ``["-m", module]``."""
        return [self.path] if self.path is not None else ["-m", str(self.module)]

    def __str__(self) -> str:
        return " ".join([*self.argv, *self.args])


def split_command(argv: list[str], value_options: Collection[str]) -> tuple[list[str], Target]:
    """Splits ``argv`` into the launcher's own options and the :class:`Target`.

    The target starts at the first argument that is neither an option nor the
    value of one of ``value_options`` (options written ``--opt VALUE``), at
    ``-m MODULE``, or after ``--``.

    Raises:
        InvalidArgumentError: no script or module is given (naming ``argv``).
    """
    own: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            if i + 1 >= len(argv):
                break
            return own, Target(argv[i + 1], None, tuple(argv[i + 2 :]))
        if arg == "-m":
            if i + 1 >= len(argv):
                raise InvalidArgumentError(f"-m needs a module name in {argv!r}")
            return own, Target(None, argv[i + 1], tuple(argv[i + 2 :]))
        if arg.startswith("-m") and not arg.startswith("--") and len(arg) > 2:
            return own, Target(None, arg[2:], tuple(argv[i + 1 :]))
        if arg.startswith("-") and arg != "-":
            own.append(arg)
            if arg in value_options and i + 1 < len(argv):
                own.append(argv[i + 1])
                i += 1
            i += 1
            continue
        return own, Target(arg, None, tuple(argv[i + 1 :]))
    if any(a in ("-h", "--help") for a in own):
        return own, Target(None, None)
    raise InvalidArgumentError(f"no script (or -m MODULE) to run in {argv!r}")


def run_target(target: Target) -> None:
    """Runs ``target`` in this process as ``__main__``, with ``sys.argv`` set as ``python`` would.

    For a script, ``sys.argv == [SCRIPT, *ARGS]`` and the script's directory
    comes first on ``sys.path``; for a module, ``sys.argv[0]`` is its file and
    the current directory comes first.  Exceptions (``SystemExit`` included)
    propagate.

    Raises:
        InvalidArgumentError: the script does not exist.
    """
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if target.path is not None:
            if not os.path.exists(target.path):
                raise InvalidArgumentError(f"script {target.path!r} does not exist")
            sys.argv = [target.path, *target.args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target.path)))
            runpy.run_path(target.path, run_name="__main__")
        else:
            sys.argv = [str(target.module), *target.args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(str(target.module), run_name="__main__", alter_sys=True)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
