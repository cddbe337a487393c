"""On-device service: loads bundles, generates text, serves the local API, reports telemetry."""


def quiet_interrupt_while_loading() -> None:
    """Ctrl-C while a command line loads (its imports take ~0.8 s: onnxruntime, numpy) exits 130 with no
    traceback; clikit.run() hands SIGINT back to Python once the command runs (click's "Aborted!").

    os._exit, not sys.exit: SystemExit raised while onnxruntime's native module initializes became
    "ImportError: initialization failed" with a traceback, or a segfault (up to 14 and 3 of 200 Ctrl-Cs at random
    moments); nothing is written yet that an exit without cleanup would lose."""
    import _signal  # the builtin under `signal`: importing signal builds its enums, a window of its own
    import os

    _signal.signal(_signal.SIGINT, lambda *_: os._exit(130))


def main() -> None:
    """edge-agent's entry point: the handler first, then the imports."""
    quiet_interrupt_while_loading()
    from agent.service.cli import main as cli_main

    cli_main()
