"""flexgemma's Hydra launchers: every sweep job in its own process (through submitit), resumable,
with failures recorded instead of ending the sweep. See launcher.py."""
