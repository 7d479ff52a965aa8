"""The built-in trainers' far side: each runs as `python -m tether.remote.builtin.<name>` with its own packages."""
