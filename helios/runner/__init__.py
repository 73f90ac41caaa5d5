"""The torch side of helios: KV cache, input batch, model runner, sampler and logprobs.

Imports torch, helios.core, helios.engine.messages, helios.models and helios.layers; never the frontend,
output or server packages.
"""
