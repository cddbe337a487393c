"""Offline model builder: checkpoint (GGUF or safetensors) -> ONNX graph -> quantized, evaluated bundle."""


def main() -> None:
    """edge-quantize's entry point: a quiet Ctrl-C first, then the imports (see agent.quiet_interrupt_while_loading)."""
    from agent import quiet_interrupt_while_loading

    quiet_interrupt_while_loading()
    from quantize.cli import main as cli_main

    cli_main()
