"""The service on top: serving wiring, the model's lifecycle, preflight checks, sd_notify and the CLI."""
