"""Offline model builder: checkpoint (GGUF or safetensors) -> ONNX graph -> quantized, evaluated bundle."""
