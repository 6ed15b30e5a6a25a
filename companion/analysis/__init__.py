"""Measuring models: the calculator, decode cost, diagnostics, peak memory, receptive
fields, scaling fits, length extrapolation."""
