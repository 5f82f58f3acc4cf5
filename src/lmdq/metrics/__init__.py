"""Queue metrics for Prometheus, read once per Redis by the exporter process (its Redis read:
``queue_stats``)."""
