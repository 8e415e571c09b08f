"""``python -m rametfs``: the command-line interface."""

from rametfs.cli import main

main(prog_name="rametfs")
