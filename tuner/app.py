"""The ``tune`` command's Typer app and console, and the helpers its commands share.

``cli.py`` adds the tuning command itself (the app's callback) and imports ``commands.py``, which
adds the commands that inspect and move stored results, so importing the CLI registers them all.

Every command runs under one handler (:class:`TuneGroup`): an ordinary failure prints one or two
lines from :func:`.failures.explain` and exits with status 1; a usage error prints ``error: ...``
and ``try: tune --help`` and exits with click's status 2.
``--debug``, accepted anywhere on the line, shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from typer.core import TyperGroup

from tritune.configs_db.records import key_text
from tritune.configs_db.values import printable

from .failures import CommandError, explain, import_error


def _click_exception(name: str) -> Any:
    """A click exception class, found through typer's public ``BadParameter``: recent typer releases
    carry their own copy of click and older ones use the click package, so neither is imported."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


UsageError = _click_exception("UsageError")
ClickException = _click_exception("ClickException")

# Without a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
#: Errors go to stderr, never wrapped: a message is one line however long.
error_console = Console(stderr=True, soft_wrap=True)
#: The flag that shows tracebacks; taken out of the arguments wherever it stands.
DEBUG_FLAG = "--debug"


def plain(value: object) -> str:
    """``value`` as text safe to embed in a rich markup string: escaped control characters and markup."""
    return escape(printable(str(value), limit=1000))


def _debug_from_settings() -> bool:
    from tritune.kernels import settings

    try:
        level: str = settings.settings(strict=True).log_level
    except ValueError:
        return False
    return level == "DEBUG"


class TuneGroup(TyperGroup):
    """The ``tune`` group: every command (and the tuning callback) under one error handler."""

    debug = False

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        given = list(sys.argv[1:] if args is None else args)
        # --debug may follow a subcommand (tune show --debug), where click would not know it;
        # "--" ends the options, so a file named --debug after it stays an argument.
        end = given.index("--") if "--" in given else len(given)
        self.debug = DEBUG_FLAG in given[:end]
        given = [arg for arg in given[:end] if arg != DEBUG_FLAG] + given[end:]
        if not standalone_mode:
            return super().main(given, prog_name, complete_var, False, windows_expand_args, **extra)
        # Click's standalone mode prints a usage error in a box of five lines or more; the error
        # and where to look are enough, so the errors are caught here and the exit is ours.
        try:
            result = super().main(given, prog_name, complete_var, False, windows_expand_args, **extra)
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "tune"
            error_console.print(Text(f"error: {exc.format_message()}", style="red"))
            error_console.print(Text(f"try: {where} --help"))
            sys.exit(exc.exit_code)
        except ClickException as exc:
            error_console.print(Text(f"error: {exc.format_message()}", style="red"))
            sys.exit(exc.exit_code)
        except typer.Abort:
            error_console.print("Aborted!")
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)

    def invoke(self, ctx: Any) -> Any:
        try:
            _check_settings()
            return super().invoke(ctx)
        except (typer.TyperException, typer.Exit, typer.Abort):
            # Usage errors (status 2), explicit exits and ^C keep click's handling.
            raise
        except Exception as exc:
            if self.debug or _debug_from_settings():
                raise
            failure = explain(exc)
            for number, line in enumerate(failure.lines()):
                error_console.print(Text(f"error: {line}" if number == 0 else line, style="red" if number == 0 else ""))
            raise typer.Exit(1) from None


def _check_settings() -> None:
    """Refuse a bad ``TRITUNE_*`` value before any work (the runtime would warn and use the default)."""
    from tritune.kernels import settings

    problems = settings.validate_environment()
    if problems:
        raise CommandError(
            "; ".join(problems), "tune refuses a bad value where the runtime falls back: fix or unset the variable"
        )


app = typer.Typer(
    cls=TuneGroup,
    add_completion=False,
    invoke_without_command=True,
    no_args_is_help=False,
    # A traceback's locals could show a database password.
    pretty_exceptions_show_locals=False,
    help="Tune tritune's Triton kernels into a persistent config DB, and inspect or ship the results.",
)


def interpreter_on() -> bool:
    """Whether Triton runs on its interpreter: ``TRITON_INTERPRET=1`` was set before triton was imported.

    Triton decides interpreter or compiler when a function is decorated, and its own library
    (``tl.sum``, ``tl.max``) is decorated at ``import triton``: setting the variable later leaves
    those compiled, and any kernel calling them fails on the CPU.
    """
    if "triton" not in sys.modules:
        return True
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(tl.sum, InterpretedFunction) or not isinstance(tl.sum, JITFunction)


def choose_device(device: str, *, stores: bool = True) -> Any:
    """Resolve --device, switching Triton to its interpreter before any kernel is defined.

    ``stores``: the command stores results (named in the note printed for the interpreter).
    """
    import torch

    wanted = device.strip().lower()
    explicit = wanted == "cpu"
    if wanted == "auto":
        wanted = "0" if torch.cuda.is_available() else "cpu"
    if wanted == "cpu":
        from tritune.kernels._interpreter import fix_interpreter_index

        if not interpreter_on():
            raise CommandError(
                "--device cpu runs on Triton's interpreter, but triton was imported without TRITON_INTERPRET=1",
                "set TRITON_INTERPRET=1 before anything imports triton (the tune command does so itself)",
            )
        os.environ["TRITON_INTERPRET"] = "1"
        fix_interpreter_index()
        why = "no GPU visible: running on the Triton interpreter"
        if explicit:
            why = "running on the Triton interpreter (--device cpu)"
        stored = " and results are stored under the pseudo-device 'cpu-interpreter'" if stores else ""
        console.print(f"[yellow]{why} at tiny shapes. Times are CPU wall-clock{stored}.[/yellow]")
        return torch.device("cpu")
    index = wanted.removeprefix("cuda:")
    if not index.isdigit():
        raise typer.BadParameter(f"--device {device!r}: expected auto, cpu, an index such as 0, or cuda:N")
    if not torch.cuda.is_available():
        raise typer.BadParameter(f"--device {device!r}: no CUDA GPU is visible (use --device cpu)")
    if int(index) >= torch.cuda.device_count():
        raise typer.BadParameter(f"--device {device!r}: only {torch.cuda.device_count()} GPU(s) visible")
    torch.cuda.set_device(int(index))
    return torch.device("cuda", int(index))


def db_url(db: str | None) -> str:
    """The config DB URL of ``--db`` (a URL or a file path), else of the settings."""
    from tritune.kernels import settings

    url: str = settings.db_url_from(db) if db else settings.settings().db_url
    return url


def check_database_path(url: str, *, must_exist: bool) -> None:
    """Name what is wrong with a SQLite DB path before SQLite does ("disk I/O error" for a folder;
    opening a FIFO blocks until something writes to it; "File exists" for a folder to be created
    where a file is).

    ``must_exist`` is for commands that only read: they must not create a file where none is.
    """
    from tritune.configs_db.urls import blocking_ancestor, not_a_db_file, sqlite_file

    path = sqlite_file(url)
    if path is None:
        return
    shown = printable(str(path))
    refusal = not_a_db_file(path)
    if refusal is not None:
        raise CommandError(refusal, "give the path of a file with --db")
    if must_exist and not os.path.lexists(path):
        raise CommandError(
            f"no config DB at {shown}",
            "give the path of an existing DB with --db (or TRITUNE_DB); a tuning run creates one",
        )
    blocked = blocking_ancestor(path)
    if blocked is not None:
        ancestor, kind = blocked
        raise CommandError(
            f"{printable(str(ancestor))} is {kind}, so the DB's folder cannot be created",
            "give --db the path of a file in a folder (missing folders are created)",
        )


def check_kernel_names(names: list[str]) -> None:
    """Refuse an unknown kernel name, or a file that is not there, before anything is imported.

    ``--kernel`` takes a kernel's name (built in, declared by an installed package's ``tritune.kernels``
    entry point) or where a declaration is: ``package.module:NAME`` or ``path/to/file.py:NAME``.
    """
    from tritune.kernels import registry

    known: list[str] | None = None
    for name in names:
        if registry.is_target(name):
            where = name.rpartition(":")[0]
            if registry.is_path(where) and not Path(where).expanduser().is_file():
                raise typer.BadParameter(f"{name!r}: no such file {where}", param_hint="--kernel")
            continue
        known = registry.kernel_names() if known is None else known
        if name not in known:
            raise typer.BadParameter(
                f"{name!r}: known kernels are {', '.join(known)} (or name a declaration: package.module:NAME "
                "or path/to/file.py:NAME)",
                param_hint="--kernel",
            )


def load_kernels(names: list[str] | None, *, tunable: bool = False) -> list[Any]:
    """The kernels ``--kernel`` names (declarations imported), or every known one without names.

    Call it after :func:`choose_device`: a declaration's Triton kernels are compiled or interpreted
    as Triton's mode is when they are defined. ``tunable``: without names, leave out the kernels
    declared without a tuning half.
    """
    from tritune.kernels import registry

    from .keys import can_tune

    specs: dict[str, Any] = {}
    for name in names or registry.kernel_names():
        try:
            spec = registry.load(name) if registry.is_target(name) else registry.find(name)
        except KeyError as exc:
            raise typer.BadParameter(str(exc.args[0]), param_hint="--kernel") from None
        except Exception as exc:
            if registry.is_target(name):
                raise import_error(exc, f"{name.rpartition(':')[0]} (named by --kernel {name})") from exc
            if name in registry.builtin_names():
                raise
            raise import_error(exc, f"kernel {name} (an installed package's tritune.kernels entry point)") from exc
        if not names and tunable:
            try:
                if not can_tune(spec):
                    continue
            except CommandError as exc:
                # A kernel nobody named whose tuning half fails to import must not stop the others.
                console.print(f"[yellow]{plain(spec.name)} is left out: {plain(exc)}[/yellow]", soft_wrap=True)
                continue
        specs.setdefault(spec.name, spec)
    return list(specs.values())


#: The key text every command prints (one helper for the runtime's logs and the tuner's tables).
short_key = key_text
