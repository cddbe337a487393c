"""edge-agent generate: the --json object, one-line user errors, and a clean end when the reader goes away or
the user presses Ctrl-C (the engine thread must leave ONNX Runtime before the interpreter exits); the three
command lines' help (every option explained, with its default) and -v after the command."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest

from quantize.package import build_bundle
from quantize.precision import QuantSpec

AGENT = [sys.executable, "-m", "agent.service.cli", "generate"]
CRASH_SIGNS = ("Traceback", "terminate called", "internal error", "Fatal Python error")


@pytest.fixture(scope="module")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("cli") / "fp32", name="tiny",
                        progress=lambda s: None)


def generate(*args: str | bytes, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*AGENT, *args], capture_output=True, timeout=120, **kw)


def test_json_prints_one_object_with_the_figures(tiny_bundle):
    r = generate("--model", str(tiny_bundle.path), "--max-tokens", "7", "--ignore-eos", "--json", "hello")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["completion_tokens"] == 7 and out["finish_reason"] == "length" and out["prompt_tokens"] > 0
    assert out["ttft_ms"] > 0 and out["decode_tokens_per_s"] > 0 and out["peak_rss_mb"] > 0
    assert isinstance(out["text"], str)


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "3", b"caf\xe9"], "the prompt is not valid UTF-8"),
    (["--max-tokens", "0", "hi"], "Error: max_tokens: max_tokens must be >= 1, got 0"),
    (["--memory-budget-mb", "200000000", "hi"], "the KV cache it plans (199999"),
])
def test_bad_input_is_one_line_and_exit_1(tiny_bundle, args, message):
    r = generate("--model", str(tiny_bundle.path), *args)
    err = r.stderr.decode()
    assert r.returncode == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert not any(s in err for s in CRASH_SIGNS), err


def test_a_missing_bundle_is_one_line_and_exit_1(tmp_path):
    r = generate("--model", str(tmp_path / "nope"), "hi")
    err = r.stderr.decode()
    assert r.returncode == 1 and err.startswith("Error: ") and len(err.strip().splitlines()) == 1, err


def test_a_reader_that_goes_away_ends_it_quietly(tiny_bundle):
    p = subprocess.Popen([*AGENT, "--model", str(tiny_bundle.path), "--max-tokens", "4000", "--ignore-eos", "hi"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(5)
    p.stdout.close()  # as `| head -c 5` does
    err = p.stderr.read().decode()
    assert p.wait(60) == 1 and not any(s in err for s in CRASH_SIGNS), (p.returncode, err)


def test_ctrl_c_mid_stream_aborts_cleanly(tiny_bundle):
    """Found in review: Ctrl-C ended in 'terminate called without an active exception' and SIGABRT."""
    p = subprocess.Popen([*AGENT, "--model", str(tiny_bundle.path), "--max-tokens", "4000", "--ignore-eos", "hi"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    p.stdout.read(5)  # streaming has started
    os.kill(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Aborted!" in err.decode(), (p.returncode, err)
    assert not any(s in err.decode() for s in CRASH_SIGNS), err


# What runs before an entry point can install its quiet handler: the console script's import of the package
# that holds it (agent.quiet_interrupt_while_loading), a few milliseconds
PRE_HANDLER_LINES = ("from agent import main", "from agent import quiet_interrupt_while_loading",
                     "from quantize import main", "from fleet import main")


def before_the_handler(err: str) -> bool:
    """Ctrl-C came in the interpreter's own start-up (site.py) or in the import of the entry point's package,
    before any handler of ours could exist."""
    lines = err.strip().splitlines()
    return ("Fatal Python error: init_import_site" in err
            or (len(lines) >= 2 and lines[-1] == "KeyboardInterrupt" and lines[-2].strip() in PRE_HANDLER_LINES))


@pytest.mark.parametrize("delay_s", [0.05, 0.15, 0.3, 0.6])
@pytest.mark.parametrize("command", [["edge-quantize", "inspect", "/nonexistent"], ["edge-agent", "check-config"],
                                     ["edge-fleet", "devices", "--db", "/nonexistent/fleet.db"]])
def test_ctrl_c_while_a_command_line_loads_is_quiet(command, delay_s):
    """Found in review: Ctrl-C in the first ~0.8 s, while Python imports onnxruntime and numpy, printed a
    20-line traceback. At any moment it ends with 130 (or the command's own exit if it was done) and no trace."""
    p = subprocess.Popen([Path(sys.executable).parent / command[0], *command[1:]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        p.wait(timeout=delay_s)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    if before_the_handler(err):  # a loaded machine can take longer than delay_s to get there
        return
    # 1 or 2: the command had ended first, with its error; -SIGINT: it was exiting (Python's shutdown
    # restores the default action)
    assert p.returncode in (130, 1, 2, -signal.SIGINT), (p.returncode, err)
    assert not any(s in err for s in CRASH_SIGNS), err


def test_an_interrupted_command_exits_130_and_a_bug_is_one_line(tmp_path):
    """Ctrl-C: 128 + SIGINT, as shells report it (click's own runner says 1); a bug of ours: exit 2, no traceback."""
    script = tmp_path / "cli.py"
    script.write_text(
        "import sys, click\n"
        "from agent.clikit import run\n"
        "@click.group()\n"
        "def cli(): pass\n"
        "@cli.command()\n"
        "def interrupted(): raise KeyboardInterrupt\n"
        "@cli.command()\n"
        "def buggy(): raise ZeroDivisionError('x')\n"
        "@cli.command()\n"
        "def hungry(): raise MemoryError\n"
        "@cli.command()\n"
        "@click.option('--n', type=int, required=True)\n"
        "def fine(n): click.echo(n)\n"
        "run(cli, 'demo')\n")
    def demo(*args):
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parents[2])
    r = demo("interrupted")
    assert r.returncode == 130 and "Aborted!" in r.stderr
    r = demo("buggy")
    assert r.returncode == 2 and "internal error (ZeroDivisionError)" in r.stderr and "Traceback" not in r.stderr
    r = demo("hungry")  # found in review: "internal error (MemoryError): " and nothing more
    assert r.returncode == 1 and "Error: out of memory" in r.stderr and "internal error" not in r.stderr
    assert demo("fine", "--n", "3").stdout == "3\n" and demo("fine").returncode == 2 and demo("--help").returncode == 0


def _option_problems(command: click.Command, ctx: click.Context) -> list[str]:
    """What a user reading `--help` misses about command's options: no help text, or a default not shown."""
    problems = []
    for option in (p for p in command.params if isinstance(p, click.Option) and not p.hidden):
        name = f"{ctx.command_path} {option.opts[-1]}"
        if not (option.help or "").strip():
            problems.append(f"{name}: no help")
        elif option.required or option.multiple or option.is_flag:  # no default to show
            continue
        elif option.get_default(ctx, call=False) is None:
            if "default" not in option.help.lower():  # nothing to show: the help must say what happens
                problems.append(f"{name}: default None, and the help does not say what it means")
        elif "default" not in option.get_help_extra(ctx):
            problems.append(f"{name}: default {option.get_default(ctx, call=False)!r} not shown")
    return problems


@pytest.mark.parametrize("module", ["agent.service.cli", "fleet.cli", "quantize.cli"])
def test_every_option_of_every_command_has_help_and_shows_its_default(module):
    """Found by a new user: serve --threads, --memory-budget-mb, publish --key, deploy --wave-size and others
    had no help, and most defaults went unshown."""
    import importlib

    group = importlib.import_module(module).cli
    root = click.Context(group, info_name=module.split(".")[0], **group.context_settings)
    problems = _option_problems(group, root)
    for name, command in group.commands.items():
        problems += _option_problems(command, click.Context(command, info_name=name, parent=root))
    assert not problems, "\n".join(problems)


def test_verbose_works_after_the_command_too(tmp_path):
    """Found by a new user: `edge-agent serve ... -v` was "No such option: -v" (only `edge-agent -v serve` worked)."""
    import logging

    from click.testing import CliRunner

    from agent.service.cli import cli

    config = tmp_path / "agent.toml"
    config.write_text("[engine]\nmemory_budget_mb = 512\n")
    root = logging.getLogger()
    level = root.level
    try:
        r = CliRunner().invoke(cli, ["check-config", "--config", str(config), "--syntax-only", "-v"])
        assert r.exit_code == 0 and "ok" in r.output, r.output
        assert root.level == logging.INFO  # a one-shot command's -v: what the engine does
    finally:
        root.setLevel(level)
    r = subprocess.run([sys.executable, "-m", "agent.service.cli", "serve", "--model", str(tmp_path / "nope"),
                        "--socket", str(tmp_path / "a.sock"), "--state-dir", str(tmp_path / "state"), "-v"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "No such option" not in r.stderr and "nope" in r.stderr, r.stderr
    assert not any(s in r.stderr for s in CRASH_SIGNS), r.stderr
