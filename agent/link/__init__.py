"""Telemetry and the fleet link: the device database and outbox, telemetry recording, MQTT, fleet commands."""
