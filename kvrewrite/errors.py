"""Errors raised by kvrewrite."""


class RewriteError(RuntimeError):
    """A captured graph could not be rewritten; the message names the model, layer and node."""
