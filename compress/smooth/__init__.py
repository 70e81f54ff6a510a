"""`smooth` stages: exact re-parametrisations of the full-precision model that make its weights easier to round
(`awq`) or its activations easier to quantize (`smoothquant`), searched on calibration activations against the next
quantize stage's arithmetic; what they share is in `fold`."""
