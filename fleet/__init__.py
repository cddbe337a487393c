"""Fleet server: ingests device telemetry over MQTT, answers TPS queries, rolls out models."""


def main() -> None:
    """edge-fleet's entry point: a quiet Ctrl-C first, then the imports (see agent.quiet_interrupt_while_loading)."""
    from agent import quiet_interrupt_while_loading

    quiet_interrupt_while_loading()
    from fleet.cli import main as cli_main

    cli_main()
