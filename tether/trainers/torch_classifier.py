"""The built-in `torch-classifier` trainer: a small MLP on a real dataset, resumable bit for bit.

Here `Config` checks the `trainer:` section. The training itself is far-side code, shipped
with the launcher: `python -m tether.remote.builtin.torch_classifier`, which reads its
settings from run.json (and imports torch; nothing here does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from tether.remote.builtin.tables import read_table

FAR_SIDE = "tether.remote.builtin.torch_classifier"  # the module the far side runs (`python -m`)
LAYERS = ("linear", "relu", "gelu", "tanh", "dropout", "layernorm")  # "linear:64", "dropout:0.1"
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULERS = ("cosine", "none")
DEVICES = ("auto", "cpu", "cuda")
DATASETS = ("digits",)  # shipped inside scikit-learn: no download
SWEEPABLE = ("epochs", "batch_size", "lr", "optimizer", "weight_decay", "scheduler", "seed", "val_fraction",
             "dataset", "threads")


@dataclass(frozen=True)
class DataSource:
    """The user's own CSV or JSONL file (one of the job's `data.paths`) and its label column."""

    path: Optional[str] = None
    label_column: str = "label"


@dataclass(frozen=True)
class Config:
    """trainer: {type: torch-classifier, layers: [linear:64, relu, ...], epochs: 20, ...}"""

    deterministic = True  # same seed, same bits: `repro` compares artifacts bit for bit

    type: str = "torch-classifier"
    dataset: str = "digits"
    data: DataSource = DataSource()
    layers: tuple[str, ...] = ("linear:128", "relu", "dropout:0.1", "linear:64", "relu")
    epochs: int = 20
    batch_size: int = 64
    lr: float = 0.003
    optimizer: str = "adam"
    weight_decay: float = 0.0
    scheduler: str = "cosine"
    seed: int = 0
    val_fraction: float = 0.2
    device: str = "auto"
    threads: int = 0  # 0: torch's default; bitwise resume needs the same count on every attempt
    env: dict = field(default_factory=dict)

    def requires(self) -> tuple[str, ...]:
        """Python modules the far side must have to run this trainer."""
        return ("torch", "sklearn") if not self.data.path else ("torch",)

    def launch_spec(self) -> dict:
        return {"argv": ["{python}", "-m", FAR_SIDE], "resume_args": [],
                "checkpoint_path": None, "env": {str(k): str(v) for k, v in self.env.items()}}

    def sweep_problems(self, keys: list[str]) -> list[str]:
        return [f"sweep.{key}: not a torch-classifier setting that can be swept; choose from {', '.join(SWEEPABLE)}"
                for key in keys if key not in SWEEPABLE]

    def with_params(self, values: dict) -> "Config":
        """This trainer with the swept settings replaced (types checked like the file's own)."""
        from tether.config import replace_checked

        return replace_checked(self, values, "sweep")

    def problems(self) -> list[str]:
        found = [f"trainer.layers: unknown layer type {name!r} in {spec!r}; known: {', '.join(LAYERS)}"
                 for spec in self.layers for name in [spec.split(":")[0]] if name not in LAYERS]
        found += [f"trainer.layers: {spec!r} needs a number after ':' (e.g. linear:64, dropout:0.1)"
                  for spec in self.layers if spec.split(":")[0] in ("linear", "dropout") and not _number(spec)]
        for key, value, choices in (("optimizer", self.optimizer, OPTIMIZERS), ("scheduler", self.scheduler, SCHEDULERS),
                                    ("device", self.device, DEVICES), ("dataset", self.dataset, DATASETS)):
            if value not in choices:
                found.append(f"trainer.{key}: unknown {value!r}; choose one of {', '.join(choices)}")
        for key, value in (("epochs", self.epochs), ("batch_size", self.batch_size), ("lr", self.lr)):
            if value <= 0:
                found.append(f"trainer.{key} must be positive (got {value})")
        if not 0 < self.val_fraction < 1:
            found.append(f"trainer.val_fraction must be between 0 and 1 (got {self.val_fraction})")
        return found

    def check_files(self, root: str, data_paths: tuple[str, ...]) -> list[str]:
        """Problems with the user's data file, found before anything is launched."""
        if not self.data.path:
            return []
        if not any(_covers(p, self.data.path) for p in data_paths):
            return [f"trainer.data.path {self.data.path!r} is not pushed: add it to data.paths"]
        try:
            columns, rows = read_table(os.path.join(root, self.data.path), self.data.label_column)
        except (OSError, ValueError) as err:
            return [f"trainer.data.path {self.data.path!r}: {err}"]
        return [] if rows else [f"trainer.data.path {self.data.path!r} has no rows"]


def _number(spec: str) -> bool:
    try:
        float(spec.split(":", 1)[1])
        return True
    except (IndexError, ValueError):
        return False


def _covers(pushed: str, path: str) -> bool:
    pushed = pushed.rstrip("/")
    return path == pushed or path.startswith(pushed + "/")
