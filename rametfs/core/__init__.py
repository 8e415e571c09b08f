"""The rules both modes share, synchronous and mode-free: no trio, no pyfuse3, no overlay,
no fallback (import-linter contracts in pyproject.toml).  Drivers: rametfs.control.commands (the
daemon) and rametfs.fallback (in-process)."""
