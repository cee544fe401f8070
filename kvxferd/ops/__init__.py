"""Running the process: metrics, logs, files the daemon owns, bounds on listeners, test faults."""
