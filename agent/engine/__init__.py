"""The generation engine: requests, scheduling, KV memory, the ONNX Runtime runner, sampling, speculation."""
