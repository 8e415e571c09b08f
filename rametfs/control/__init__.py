"""The mount's control side, FUSE-free: the mount's tree (rametfs.control.tree) and the control
commands behind the ``.ramet/`` files (rametfs.control.commands)."""
