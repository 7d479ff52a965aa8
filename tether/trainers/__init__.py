"""Trainers: the far-side runtime, the `command` trainer and the built-in ones."""
