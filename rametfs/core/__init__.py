"""The execution service's rules, written once for both modes: synchronous, mode-free (no
trio, no pyfuse3, no overlay), driven by the FUSE daemon and by fallback mode."""
