"""Trainers, laptop side: each type's `Config` (the `trainer:` section); their far side is in tether.remote."""
