"""Trainer types by short name: the module whose `Config` dataclass reads the `trainer:` section."""

TRAINER_TYPES = {
    "command": "tether.trainers.command",
    "torch-classifier": "tether.trainers.torch_classifier",
}
