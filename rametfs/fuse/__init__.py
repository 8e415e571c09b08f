"""The FUSE side: the pyfuse3 adapter and what the kernel was told (with rametfs.daemon, the
only importers of pyfuse3)."""
