"""The one error type ignition raises for bad input; the CLI prints its message as one line."""


class ExportError(Exception):
    """A user-facing failure: bad source, unsupported format, corrupt file. No traceback is shown."""
