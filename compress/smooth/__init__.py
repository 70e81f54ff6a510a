"""`smooth` stages: exact re-parametrisations of the full-precision model that make its weights easier to round,
searched on calibration activations against the next quantize stage's rounding (`awq`)."""
