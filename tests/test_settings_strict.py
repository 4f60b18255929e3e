"""A bad ``TRITUNE_*`` value: the runtime warns and uses the default, the strict reader (``tune``) refuses
it without claiming a default is used."""

from __future__ import annotations

from typer.testing import CliRunner

from tritune.kernels import settings
from tritune.tuner.cli import app


def test_the_strict_messages_say_what_is_wrong_not_that_a_default_is_used(monkeypatch):
    monkeypatch.setenv("TRITUNE_MARGIN", "abc")
    assert settings.validate_environment() == ["TRITUNE_MARGIN='abc': expected a fraction in [0, 1) such as 0.03"]


def test_tune_refuses_a_bad_value_in_two_lines_without_a_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITUNE_MARGIN", "abc")
    result = CliRunner().invoke(app, ["missed", "--db", str(tmp_path / "none.sqlite")])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        "error: TRITUNE_MARGIN='abc': expected a fraction in [0, 1) such as 0.03",
        "tune refuses a bad value where the runtime falls back: fix or unset the variable",
    ]
