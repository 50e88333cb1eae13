"""vescale: train an unchanged single-device PyTorch model on many devices from a short plan.

The public surface is small on purpose; everything else lives in one package per concept:
``plan`` (VescalePlan and its IR), ``parallel`` (parallelize), ``random`` (single-device-semantic
distributed RNG), ``comm`` (gradient reduction), ``zoo`` (ready plans and models).
"""
