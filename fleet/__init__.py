"""Fleet server: ingests device telemetry over MQTT, answers TPS queries, rolls out models."""
