"""Forward-only building blocks of the model families: norm, rotary, linear, activation, attention, MoE.

Layers hold no weights of their own until a model binds a core's tensors into them; they import torch
and `helios.core` only, never the engine, runner or ignition.
"""
