"""ignition: offline export of checkpoints into prepared helios cores."""

__version__ = "0.1.0"
