"""The `writescope` command line: every command has help on every flag, and the in-process ones
run (the Ray ones are exercised by their own tests)."""

import json
import os
import subprocess
import sys

import pytest

from writescope.tools.cli import main

COMMANDS = ["generate", "bench", "calibrate", "simulate", "serve", "numa-scaling", "batch"]


def test_the_console_script_lists_every_command():
    script = os.path.join(os.path.dirname(sys.executable), "writescope")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert command in result.stdout


def test_every_flag_of_the_cli_has_help():
    import argparse

    from writescope.tools.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    assert set(COMMANDS) <= set(subparsers.choices)
    for name, sub in subparsers.choices.items():
        for action in sub._actions:  # noqa: SLF001
            assert action.help, f"writescope {name}: {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("command", [["generate"], ["calibrate"], ["serve"], ["bench", "cpu"], ["bench", "e2e"],
                                     ["bench", "orchestration"], ["bench", "split"], ["simulate"], ["numa-scaling"],
                                     ["batch"]])
def test_every_command_answers_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "usage:" in text and "--" in text


def test_generate_streams_the_tokens(capsys):
    assert main(["generate", "--model", "tiny-mixtral", "--prompt", "hello there", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_calibrate_prints_the_model(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    assert main(["calibrate", "--model", "tiny-mixtral"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["cpu_s_per_token"] > 0 and 0 <= fitted["r_star_at_32k"] <= 1


def test_bad_flags_name_what_is_allowed(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--policy", "fastest"])
    assert "unknown policy 'fastest'; known: writescope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--policy", "share:2"])
    assert "or share:R with R in [0, 1]" in capsys.readouterr().err


def test_generate_takes_a_fixed_share_policy(capsys):
    assert main(["generate", "--model", "tiny-mixtral", "--prompt", "hello", "--max-new-tokens", "3",
                 "--policy", "share:0.3"]) == 0
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "tiny-mixtral", "--prompt", "a\udcffb"], "lone surrogate"),  # undecodable argv bytes
    (["generate", "--model", "tiny-llama", "--prompt", "x"], "neither a checkpoint directory nor a preset"),
    (["generate", "--model", "tiny-mixtral", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be"),
])
def test_bad_input_is_an_error_message_not_a_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
