"""Adapters for agent and RL frameworks, each in its own module, importing its framework.

- :mod:`rametfs.integrations.skyrl`: a SkyRL-Gym environment whose episodes each work in a
  clean execution from a pool (``pip install 'rametfs[harness]'`` brings ``skyrl-gym``).

Importing this package imports no framework.
"""
