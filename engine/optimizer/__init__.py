"""Optimizer construction, mixed-precision master weights, grad clipping and lr / weight-decay schedules."""
