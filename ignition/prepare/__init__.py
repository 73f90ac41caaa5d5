"""Preparation steps run once at export time.

template.py  chat-template probing -> TemplateCaps (renders with helios.core.chat_template)
plan.py      the graph plan: decode buckets, prefill chunk size, page size, logprob outputs
"""
