"""`miles perftest` measurement engine: sizes, raw baselines, reference limits, reports."""
