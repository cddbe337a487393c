"""On-device service: loads bundles, generates text, serves the local API, reports telemetry."""
