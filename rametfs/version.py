"""The version of rametfs (``rametfs.__version__``), in a module of its own so that the
status of either mode (rametfs.core.status) reads it without importing the client."""

__version__ = "0.1.0"
