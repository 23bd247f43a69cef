"""What the gateway tells its operator: metrics, logs, traces, GC pauses."""
