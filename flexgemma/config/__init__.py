"""The config layer: the composed Hydra config turned once into typed dataclasses that check themselves
(schema.py), Hydra's compose API with the CLI's overrides (compose.py), the closed key sets (keys.py),
keyword arguments as overrides (overrides.py), the optional extras a config needs (extras.py), and
every `auto` decided for a device (resolve.py; kernels.py holds the kernel choices the model and engine
read). Only resolve.py imports torch or another part of the package (the model's dtype rule), so a
config can be composed, checked and printed without them."""
