"""The mount's control side, FUSE-free: the control commands behind the ``.ramet/`` files."""
