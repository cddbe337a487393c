"""edge-agent: the on-device service's command line.

Run: edge-agent generate --model BUNDLE [--adapter DIR] [--chat] [--max-tokens N] [--threads N] [--json] "prompt"
     edge-agent serve --model BUNDLE --socket PATH [--adapter NAME=DIR ...] [--config agent.toml] [--tcp HOST:PORT]
     edge-agent telemetry [--state-dir DIR] [--since 1h] [--json]
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from agent.engine.bundle import BundleError, open_bundle
from agent.clikit import run, setup_logging
from agent.config import EngineConfig
from agent.engine.memory import MemoryBudgetError
from agent.process import peak_rss_bytes

# sqlite3.Error: the telemetry database locked by another process, or unwritable (a corrupt one is set aside)
USER_ERRORS = (BundleError, MemoryBudgetError, ValueError, OSError, sqlite3.Error)


def _fail(e: Exception) -> None:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        raise click.ClickException(f"{'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}") from e
    raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from e


def _require_utf8(name: str, value: str) -> None:
    """Arguments that are not UTF-8 reach Python as lone surrogates, which no tokenizer accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8 text (is the terminal's locale UTF-8?)") from None


VERBOSE_HELP = "More on stderr: what the engine does (serve: debug lines too). Before or after the command."


def _log_level(command: str | None, verbose: bool) -> int:
    # the service says what it does (connected, reloaded, switched models: a few lines an hour); the
    # one-shot commands only what went wrong; -v one level more of each
    if command == "serve":
        return logging.DEBUG if verbose else logging.INFO
    return logging.INFO if verbose else logging.WARNING


def _verbose_after_command(ctx: click.Context, param: click.Parameter, verbose: bool) -> None:
    """`edge-agent serve ... -v`: the group set the level before this command's options were parsed."""
    if verbose:
        logging.getLogger().setLevel(_log_level(ctx.info_name, True))


def _named_folders(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Path]:
    """--adapter NAME=DIR, repeatable -> {NAME: DIR}."""
    named = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            raise click.BadParameter(f"{value!r}: give NAME=DIR, e.g. support-bot=adapters/support-bot")
        if name in named:
            raise click.BadParameter(f"{name!r} is given twice")
        named[name] = Path(folder)
    return named


def verbose_option(command):
    return click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_verbose_after_command,
                        help=VERBOSE_HELP)(command)


@click.group(context_settings={"show_default": True})
@click.option("-v", "--verbose", is_flag=True, help=VERBOSE_HELP)
def cli(verbose: bool) -> None:
    """The edge LLM agent."""
    setup_logging(_log_level(click.get_current_context().invoked_subcommand, verbose))


@cli.command()
@click.argument("prompt")
@click.option("--model", "model", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--system", default=None, help="System message (with --chat; default: none).")
@click.option("--max-tokens", type=int, default=128, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=0.0, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0,
              help="Sample from the likeliest tokens up to this probability (1 = all).")
@click.option("--top-k", type=int, default=0, help="Sample from the k likeliest tokens (0 = all).")
@click.option("--seed", type=int, default=None, help="Random seed, for the same output again (default: a new one).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--threads", type=int, default=None,
              help="ONNX Runtime's threads (default: the cores this process may use).")
@click.option("--memory-budget-mb", type=int, default=1024,
              help="Memory for the whole process, MB: weights, KV cache, activations, runtime.")
@click.option("--ignore-eos", is_flag=True, help="Go on past the end-of-sequence token, up to --max-tokens.")
@click.option("--speculative", type=click.Choice(["off", "ngram", "draft"]), default="off", show_default=True,
              help="Speculative decoding: prompt lookup (ngram) or a draft model (draft).")
@click.option("--draft-model", type=click.Path(path_type=Path), default=None,
              help="Draft bundle for --speculative draft (default: the one the model's bundle carries).")
@click.option("--kv-cache", "kv_dtype", type=click.Choice(["fp32", "int8"]), default="fp32", show_default=True,
              help="KV cache type: int8 holds 4x the tokens in the same memory.")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="Generate with this LoRA adapter folder (edge-quantize adapter; default: none, the base model).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@verbose_option
def generate(prompt, model, chat, system, max_tokens, temperature, top_p, top_k, seed, stop, threads,
             memory_budget_mb, ignore_eos, speculative, draft_model, kv_dtype, adapter, as_json):
    """Generate a completion of PROMPT, streaming it to the terminal, then print the figures.

    Example: edge-agent generate --model bundles/smollm2-int4 --chat "Name three rivers."
    """
    from agent.engine.engine import Engine
    from agent.engine.request import TextDelta
    from agent.engine.sampling_params import SamplingParams

    try:
        for name, value in (("the prompt", prompt), ("--system", system or ""), *(("--stop", s) for s in stop)):
            _require_utf8(name, value)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=list(stop), ignore_eos=ignore_eos)
        bundle = open_bundle(model)
        draft = open_bundle(draft_model) if draft_model else bundle.draft() if speculative == "draft" else None
        engine = Engine(bundle, EngineConfig(threads=threads, memory_budget_mb=memory_budget_mb,
                                             speculative=speculative, kv_dtype=kv_dtype), draft=draft,
                        adapters={"adapter": adapter} if adapter else None)
        text = prompt
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = engine.tokenizer.render_chat(messages)
        handle = engine.submit(engine.tokenizer.encode(text), params, adapter="adapter" if adapter else None)
    except (ValidationError, *USER_ERRORS) as e:
        _fail(e)
    engine.start()
    try:
        for ev in handle:
            if isinstance(ev, TextDelta) and not as_json:
                click.echo(ev.text, nl=False)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    finally:  # also on Ctrl-C: the engine thread must leave ONNX Runtime before the interpreter exits
        handle.cancel()
        engine.stop()
    f = ev.figures
    if as_json:
        click.echo(json.dumps({"text": ev.text, "prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
                               "ttft_ms": round(f.ttft_ms, 2), "decode_tokens_per_s": round(f.decode_tokens_per_s, 2),
                               "prefill_tokens_per_s": round(f.prefill_tokens_per_s, 2),
                               "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1), "finish_reason": f.finish_reason,
                               "drafted_tokens": f.drafted_tokens, "accepted_tokens": f.accepted_tokens}))
    else:
        click.echo(f"\n\n[{f.finish_reason}] prompt {f.prompt_tokens} tokens, completion {f.completion_tokens} tokens | "
                   f"TTFT {f.ttft_ms:.0f} ms | prefill {f.prefill_tokens_per_s:.0f} tok/s | "
                   f"decode {f.decode_tokens_per_s:.1f} tok/s | ITL p50/p95 {f.itl_p50_ms:.1f}/{f.itl_p95_ms:.1f} ms | "
                   f"peak RSS {peak_rss_bytes() / 2**20:.0f} MB", err=True)


@cli.command()
@click.option("--model", "model", type=click.Path(path_type=Path), default=None,
              help="Bundle directory (default: the config file's `model`).")
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None,
              help="Unix socket to listen on (default: the config's api.socket).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Agent TOML config (model, [engine], [api], [telemetry], [updates]); flags override it (default: "
                   "none, every setting at its default).")
@click.option("--threads", type=int, default=None,
              help="ONNX Runtime's threads (default: the config's [engine] threads, else the cores this "
                   "process may use).")
@click.option("--memory-budget-mb", type=int, default=None,
              help="Memory for the whole process, MB: weights, KV cache, activations, runtime (default: the "
                   "config's [engine] memory_budget_mb, else 1024).")
@click.option("--tcp", default=None, help="Also listen on HOST:PORT (loopback unless the config sets tcp_any_host; "
                                          "default: none).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Models, telemetry.db and the update journal (default: the config's telemetry.state_dir, else "
                   "$STATE_DIRECTORY, /var/lib/edge-agent as root, ~/.local/share/edge-agent otherwise).")
@click.option("--mqtt", default=None, help="Fleet broker, mqtt://HOST:PORT or mqtts://... (TLS settings: config; "
                                           "default: the config's [telemetry.mqtt] url, else none).")
@click.option("--device-id", default=None, help="This device's id on the fleet (default: the host name).")
@click.option("--trusted-key", "trusted_keys", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Public key whose signed model updates are accepted (repeatable).")
@click.option("--adapter", "adapters", multiple=True, callback=_named_folders, metavar="NAME=DIR",
              help="Serve this LoRA adapter folder as model BASE:NAME (repeatable; beside the config's [adapters] "
                   "and the state directory's adapters/ for the model).")
@verbose_option
def serve(model, socket_path, config_path, threads, memory_budget_mb, tcp, state_dir, mqtt, device_id, trusted_keys,
          adapters):
    """Serve the OpenAI-compatible API on a Unix socket, in the foreground, until SIGTERM or Ctrl-C.

    Example: edge-agent serve --model bundles/smollm2-int4 --socket /tmp/edge.sock --tcp 127.0.0.1:8080
    """
    from agent.service.sdnotify import Notifier
    from agent.api.http_server import ServeError
    from agent.service.serve import load_agent_config, serve_forever

    try:
        def load():  # at start, and again on SIGHUP (the file may have changed; the flags still win)
            return load_agent_config(config_path, model=model, socket=socket_path, threads=threads,
                                     memory_budget_mb=memory_budget_mb, tcp=tcp, state_dir=state_dir, mqtt=mqtt,
                                     device_id=device_id, trusted_keys=list(trusted_keys), adapters=adapters)

        serve_forever(load(), announce=lambda line: click.echo(line, err=True),
                      notifier=Notifier.from_environment(dict(os.environ)),  # systemd's protocol is env-based
                      reload_config=load)
    except (ValidationError, ServeError, *USER_ERRORS) as e:
        _fail(e)


@cli.command()
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory holding telemetry.db (default: $STATE_DIRECTORY, else /var/lib/edge-agent as root, "
                   "else ~/.local/share/edge-agent; a state_dir set in agent.toml is not read: pass it here).")
@click.option("--since", default="1h", show_default=True, help="Window: a number and s, m, h or d.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@verbose_option
def telemetry(state_dir, since, as_json):
    """Summarise this device's recorded telemetry: decode speed and TTFT p50/p95 by model, version and hour,
    and requests by finish reason.

    Example: edge-agent telemetry --state-dir /var/lib/edge-agent --since 6h
    """
    import sqlite3

    from agent.config import TelemetryConfig
    from agent.link.telemetry import format_summary, parse_window, summary

    try:
        result = summary(state_dir or TelemetryConfig().state_dir, parse_window(since))
    except (ValueError, OSError, sqlite3.Error) as e:
        _fail(e)
    click.echo(json.dumps(result, indent=2) if as_json else format_summary(result))


@cli.command("check-config")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path),
              help="The agent's TOML config file, e.g. /etc/edge-agent/agent.toml.")
@click.option("--syntax-only", is_flag=True,
              help="Only validate the file (on another machine than the device: skip the model, group and key checks).")
@verbose_option
def check_config(config_path, syntax_only):
    """Validate a config file, and check what `serve` needs on this machine (the model bundle, the socket
    group, the trusted keys, writable directories) without starting anything; exit 0 when none of that would
    stop serve. The model's exact memory need is measured only when serve loads it: a budget below the
    weights' size is caught here, one a little short of the runtime's need is refused at start.

    Example: edge-agent check-config --config /etc/edge-agent/agent.toml
    """
    from agent.config import describe_errors
    from agent.api.http_server import ServeError
    from agent.service.preflight import environment_problems, parameters_note
    from agent.service.serve import load_agent_config

    try:
        config = load_agent_config(config_path)
    except ValidationError as e:
        raise click.ClickException(f"{config_path}: invalid configuration\n{describe_errors(e)}") from e
    except ServeError as e:  # a section that is not a table, a file that is not UTF-8: the message says which
        raise click.ClickException(str(e)) from e
    except (OSError, ValueError) as e:  # unreadable file, TOML syntax error (tomllib's error names the line)
        raise click.ClickException(f"{config_path}: {e}") from e
    problems = [] if syntax_only else environment_problems(config)
    if problems:
        raise click.ClickException(f"{config_path}: valid, but serve would refuse it on this machine:\n"
                                   + "\n".join(problems))
    note = "" if syntax_only else parameters_note(config)
    click.echo(f"{config_path}: ok (model {config.model}{note}, memory budget {config.engine.memory_budget_mb} MB, "
               f"socket {config.api.socket})")


def main() -> None:
    run(cli, "edge-agent")


if __name__ == "__main__":
    main()
