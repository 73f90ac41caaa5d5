"""helios: the runtime that memory-maps a prepared core and serves it."""

__version__ = "0.1.0"
