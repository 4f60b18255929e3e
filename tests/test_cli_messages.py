"""What ``tune`` says and its exit status where the user got something wrong or nothing was stored:
the interpreter switched on by the command itself, import errors of a user's module, usage errors
in one or two lines, and user kernels named where a command cannot know them.

Tests that depend on when Triton is imported run the real ``tune`` entry point in a child process
without ``TRITON_INTERPRET`` (the test process has it set by ``conftest.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tritune.tuner.cli import app

ROOT = Path(__file__).resolve().parent.parent
RMSNORM = f"{ROOT / 'examples' / 'rmsnorm.py'}:RMSNORM"
#: The console script's entry (``tune``), and the CLI's own main, which skips the entry's checks.
ENTRY = [sys.executable, "-c", "import sys; sys.argv[0] = 'tune'; from tritune.tuner.entry import main; main()"]
CLI_MAIN = [sys.executable, "-c", "from tritune.tuner.cli import main; main()"]
runner = CliRunner(env={"COLUMNS": "250"})


@pytest.fixture(autouse=True)
def forget_declared_kernels():
    """Kernels a test declares are forgotten after it (the built-in ones stay).

    Some are broken on purpose (a tuning half that cannot be imported): left declared, they would
    fail every later ``tune list`` in the same process, which lists each kernel declared in it."""
    from tritune.kernels import registry

    before = set(registry._DECLARED)
    yield
    for name in set(registry._DECLARED) - before - set(registry.builtin_names()):
        del registry._DECLARED[name]
        registry._TARGETS.pop(name, None)


def run(*args: str) -> Result:
    return runner.invoke(app, list(args), prog_name="tune")


def child(command: list[str], *args: str, interpret: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    """``command`` with ``args`` in a child process; ``TRITON_INTERPRET`` unset unless ``interpret``."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env, COLUMNS="250")
    if interpret:
        environ["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env=environ, timeout=300, check=False, cwd=ROOT
    )


def test_bench_on_cpu_switches_the_interpreter_on_itself_and_says_nothing_of_storing(tmp_path):
    done = child(ENTRY, "bench", "--device", "cpu", "--kernel", RMSNORM, "--db", str(tmp_path / "b.sqlite"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "running on the Triton interpreter (--device cpu)" in done.stdout
    assert "No GPU" not in done.stdout and "stored" not in done.stdout


def test_tune_on_cpu_in_process_switches_the_interpreter_on_itself(tmp_path):
    db = tmp_path / "t.sqlite"
    done = child(ENTRY, "--device=cpu", "--no-isolate", "--kernel", RMSNORM, "--trials", "1", "--db", str(db))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "results are stored under the pseudo-device 'cpu-interpreter'" in done.stdout
    assert "no winner stored" not in done.stdout


def test_the_interpreter_switched_on_too_late_is_refused_in_one_line(tmp_path):
    done = child(CLI_MAIN, "bench", "--device", "cpu", "--kernel", RMSNORM, "--db", str(tmp_path / "b.sqlite"))
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()
    assert error[0].startswith("error: --device cpu runs on Triton's interpreter"), done.stderr
    assert "TRITON_INTERPRET=1" in done.stderr and len(error) == 2 and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (["bench", "--device", "cpu"], "cpu"),
        (["--device=cpu,cpu", "--kernel", "x"], "cpu,cpu"),
        (["--kernel", "x"], "auto"),
        (["--device", "0", "--", "--device", "cpu"], "0"),
    ],
)
def test_the_entry_reads_the_device_before_click(argv, wanted):
    from tritune.tuner.entry import device_argument, needs_interpreter

    assert device_argument(argv) == wanted
    assert needs_interpreter("cpu") and needs_interpreter("cpu,cpu") and not needs_interpreter("0")


@pytest.mark.parametrize(
    ("args", "lines"),
    [
        (["--bogus"], ["error: No such option: --bogus", "try: tune --help"]),
        (["status"], ["error: Missing option '--storage'.", "try: tune status --help"]),
        (["--trials", "0"], ["error: Invalid value for '--trials': ", "try: tune --help"]),
    ],
)  # fmt: skip
def test_a_usage_error_is_two_lines_with_status_2(args, lines):
    result = run(*args)
    assert result.exit_code == 2, result.output
    first, second = result.output.strip().splitlines()
    assert first.startswith(lines[0]) and second == lines[1], result.output


def test_the_real_command_prints_a_usage_error_in_two_lines():
    done = child(ENTRY, "--bogus", interpret=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["error: No such option: --bogus", "try: tune --help"]


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["--key", "head_dim=7"], "(head_dim: one of 64, 128, 256 of the powers of two at the default keys)"),
        (["--lq", "100"], "(lq_bucket: a power of two from 1 to 64 at the default keys)"),
        (["--key", "lq_bucket=100"], "(lq_bucket: a power of two)"),
        (["--key", "dtype=fp9"], "(dtype: the default keys hold bf16)"),
    ],
)
def test_a_key_value_no_key_accepts_is_named_with_what_the_field_accepts(args, hint):
    result = run("--device", "cpu", "--kernel", "tma_prefill", *args)
    assert result.exit_code == 2, result.output
    assert "no key of tma_prefill remains valid with these values " + hint in " ".join(result.output.split())


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Modules of a user's on ``sys.path``: one that raises, one that imports a missing package, and a
    declaration whose ``tuning="module:ATTRIBUTE"`` names a missing module."""
    (tmp_path / "user_raises.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "user_needs_missing.py").write_text("import user_missing_package_abc\n")
    text = (ROOT / "examples" / "rmsnorm.py").read_text().replace('"example_rmsnorm"', '"user_bad_tuning"')
    (tmp_path / "user_bad_tuning.py").write_text(text.replace("tuning=RMSNormTuning()", 'tuning="user_nosuch:TUNING"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("target", "first", "second"),
    [
        (
            "user_nosuch_module:K",
            "error: cannot import user_nosuch_module (named by --kernel user_nosuch_module:K): No module named "
            "'user_nosuch_module'",
            "check the module name and PYTHONPATH",
        ),
        (
            "user_needs_missing:K",
            "error: cannot import user_needs_missing (named by --kernel user_needs_missing:K): No module named "
            "'user_missing_package_abc'",
            "check the module name and PYTHONPATH",
        ),
        (
            "user_raises:K",
            "error: cannot import user_raises (named by --kernel user_raises:K): RuntimeError: boom",
            "the module failed; run with --debug for the traceback",
        ),
        (
            "user_bad_tuning:RMSNORM",
            'error: cannot import the tuning half of kernel user_bad_tuning (named by its tuning="module:ATTRIBUTE"): '
            "No module named 'user_nosuch'",
            "check the module name and PYTHONPATH",
        ),
    ],
)
def test_a_users_module_that_does_not_import_is_named_with_the_option_naming_it(user_modules, target, first, second):
    result = run("--device", "cpu", "--kernel", target, "--db", str(user_modules / "t.sqlite"))
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-2:] == [first, second]
    assert "reinstall" not in result.output


def test_a_missing_module_of_tritune_or_its_dependencies_still_calls_for_a_reinstall():
    from tritune.tuner.failures import import_error

    missing = ModuleNotFoundError("No module named 'triton.backends'", name="triton.backends")
    assert import_error(missing, "x (named by --kernel x:K)").failure.todo == "reinstall tritune with its dependencies"


def failing_example(folder: Path, name: str, fails_at: str) -> str:
    """The RMSNorm example as kernel ``name``, whose problem cannot be set up where ``fails_at`` holds."""
    text = (ROOT / "examples" / "rmsnorm.py").read_text().replace('"example_rmsnorm"', f'"{name}"')
    setup = "        gen = torch.Generator(device=device).manual_seed(seed)\n"
    assert setup in text
    text = text.replace(setup, f"        if {fails_at}:\n            raise RuntimeError('no problem here')\n{setup}")
    path = folder / f"{name}.py"
    path.write_text(text)
    return f"{path}:RMSNORM"


@pytest.mark.parametrize(
    ("name", "fails_at", "last"),
    [
        ("user_fails_all", "True", "no winner stored: 2 of 2 key(s) failed (see above)"),
        ("user_fails_one", "key.n_bucket == 256", "1 of 2 key(s) failed (see above); done in"),
    ],
)
def test_a_tune_where_a_key_failed_says_how_many_and_exits_1(tmp_path, name, fails_at, last):
    target = failing_example(tmp_path, name, fails_at)
    db = f"sqlite:///{tmp_path / 'f.sqlite'}"
    result = run("--device", "cpu", "--no-isolate", "--trials", "1", "--kernel", target, "--db", db)
    assert result.exit_code == 1, result.output
    assert last in result.output.strip().splitlines()[-1]
    assert "winners stored" not in result.output


def user_example(folder: Path, name: str) -> str:
    """The RMSNorm example declared as kernel ``name`` (a name is declared once per process)."""
    text = (ROOT / "examples" / "rmsnorm.py").read_text().replace('"example_rmsnorm"', f'"{name}"')
    path = folder / f"{name}.py"
    path.write_text(text)
    return f"{path}:RMSNORM"


def test_list_shows_a_users_kernel_named_with_kernel(tmp_path):
    target = user_example(tmp_path, "user_listed")
    result = run("list", "--kernel", target)
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert output.startswith("user_listed (version ") and "key: dtype (str), n_bucket (int)" in output
    assert "tma_prefill" not in output
    assert run("list", "--kernel", "nope").exit_code == 2


def test_show_says_a_users_kernel_is_not_declared_here(tmp_path):
    from tritune.configs_db.records import WinnerRecord
    from tritune.configs_db.store import ConfigStore
    from tritune.kernels.device import interpreter_device

    cpu = interpreter_device()
    record = WinnerRecord(
        kernel="user_not_declared",
        kernel_version="v1",
        gpu=cpu.slug,
        key={"arch": cpu.arch, "sm_count": cpu.sm_count, "n_bucket": 64},
        config={"BLOCK_N": 64},
        time_ms=0.1,
        portable_ms=0.2,
        speedup=2.0,
        trials=3,
        torch_version="t",
        triton_version="t",
        tritune_version="t",
    )
    db = f"sqlite:///{tmp_path / 's.sqlite'}"
    with ConfigStore(db) as store:
        env = store.environment(gpu=cpu.slug, torch_version="t", triton_version="t", tritune_version="t")
        assert store.offer_winner(record, env)
    result = run("show", "--db", db, "--device", "cpu")
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "user_not_declared n_bucket=64: kernel not declared here (add --kernel package.module:NAME)" in output
    assert "unknown kernel" not in output


def test_status_resolves_a_declaration_to_its_kernel_name(tmp_path, monkeypatch):
    from tritune.tuner import commands

    journal = tmp_path / "studies.log"
    journal.write_text("")
    asked = []
    monkeypatch.setattr(commands, "status_rows", lambda where, **given: asked.append(given["kernel"]) or [])
    result = run("status", "--storage", str(journal), "--kernel", user_example(tmp_path, "user_status"))
    assert result.exit_code == 0, result.output
    assert asked == ["user_status"]


def test_a_declared_kernel_whose_tuning_half_fails_is_left_out_when_no_kernel_is_named(tmp_path, monkeypatch):
    from tritune.kernels import registry
    from tritune.tuner.app import load_kernels

    text = (ROOT / "examples" / "rmsnorm.py").read_text().replace('"example_rmsnorm"', '"user_bad_unnamed"')
    path = tmp_path / "user_bad_unnamed.py"
    path.write_text(text.replace("tuning=RMSNormTuning()", 'tuning="user_nosuch_half:TUNING"'))
    registry.load(f"{path}:RMSNORM")
    names = [spec.name for spec in load_kernels(None, tunable=True)]
    assert "user_bad_unnamed" not in names and "tma_prefill" in names


def test_list_goes_on_past_a_kernel_whose_tuning_half_cannot_be_imported(tmp_path):
    """``tune list`` names such a kernel with the reason and still lists the others (exit 0)."""
    from tritune.kernels import registry

    text = (ROOT / "examples" / "rmsnorm.py").read_text().replace('"example_rmsnorm"', '"user_bad_listed"')
    path = tmp_path / "user_bad_listed.py"
    path.write_text(text.replace("tuning=RMSNormTuning()", 'tuning="user_nosuch_listed:TUNING"'))
    registry.load(f"{path}:RMSNORM")
    result = run("list")
    assert result.exit_code == 0, result.output
    assert "user_bad_listed: cannot import the tuning half of kernel user_bad_listed" in result.output
    assert "tma_prefill (version" in result.output
