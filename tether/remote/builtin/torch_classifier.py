"""The far side of `torch-classifier`: a training loop, deterministic, checkpointed, resumable bit for bit.

Run as `python -m tether.remote.builtin.torch_classifier` (the laptop's settings class is
tether.trainers.torch_classifier.Config; this side reads them from run.json).

Everything that decides the next batch or the next dropout mask is in the checkpoint: model,
optimizer, scheduler, the RNG states of Python, NumPy and torch, and the step (which gives the
epoch and the position in it; each epoch's order is a pure function of seed and epoch).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import sys
import time
from typing import Any

import torch
from torch import nn

from tether.remote import runtime
from tether.remote.builtin.tables import read_table


def settings() -> dict:
    with open(os.path.join(os.environ["TETHER_RUN_DIR"], "run.json")) as f:
        return json.load(f)["trainer"]


def load_data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Features (float32), labels (int64) and class names, from digits or the user's file."""
    source = cfg["data"]
    if source.get("path"):
        features, rows = read_table(os.path.join(os.environ["TETHER_DATA_DIR"], source["path"]),
                                    source["label_column"])
        classes = sorted({str(r[source["label_column"]]) for r in rows})
        index = {c: i for i, c in enumerate(classes)}
        x = torch.tensor([[float(r[c]) for c in features] for r in rows], dtype=torch.float32)
        y = torch.tensor([index[str(r[source["label_column"]])] for r in rows], dtype=torch.int64)
        x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
        return x, y, classes
    from sklearn.datasets import load_digits  # the 1,797 8x8 images ship inside scikit-learn

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.int64), [str(c) for c in range(10)]


def split(n: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded train/validation split: the same seed always gives the same indices."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg["seed"]))
    n_val = max(1, int(round(n * cfg["val_fraction"])))
    return order[n_val:], order[:n_val]


def build_model(cfg: dict, n_in: int, n_out: int) -> nn.Sequential:
    layers, width = [], n_in
    for spec in cfg["layers"]:
        name, _, arg = spec.partition(":")
        if name == "linear":
            layers.append(nn.Linear(width, int(arg)))
            width = int(arg)
        elif name == "dropout":
            layers.append(nn.Dropout(float(arg)))
        elif name == "layernorm":
            layers.append(nn.LayerNorm(width))
        else:
            layers.append({"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}[name]())
    layers.append(nn.Linear(width, n_out))
    return nn.Sequential(*layers)


def make_optimizer(cfg: dict, model: nn.Module, total_steps: int) -> tuple[Any, Any]:
    params, lr, wd = model.parameters(), cfg["lr"], cfg["weight_decay"]
    optimizer = {"adam": lambda: torch.optim.Adam(params, lr=lr, weight_decay=wd),
                 "adamw": lambda: torch.optim.AdamW(params, lr=lr, weight_decay=wd),
                 "sgd": lambda: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)}[cfg["optimizer"]]()
    if cfg["scheduler"] == "cosine":
        return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def choose_device(cfg: dict) -> torch.device:
    if cfg["device"] == "cuda" or (cfg["device"] == "auto" and torch.cuda.is_available()):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        return torch.device("cuda")
    return torch.device("cpu")


def rng_state() -> dict:
    import numpy

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [v.tolist() if hasattr(v, "tolist") else v for v in numpy.random.get_state()]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy

    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(1) == y).float().mean().item()
    model.train()
    return loss, accuracy


def save_model(model: nn.Module, folder: str) -> str:
    """The final weights: model.safetensors when safetensors is installed, else model.pt."""
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    try:
        from safetensors.torch import save_file
    except ImportError:
        path = os.path.join(folder, "model.pt")
        torch.save(weights, path)
        return path
    path = os.path.join(folder, "model.safetensors")
    save_file(weights, path)
    return path


def main() -> None:
    cfg = settings()
    stop = runtime.stop_signal()
    torch.use_deterministic_algorithms(True)
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    device = choose_device(cfg)
    x, y, classes = load_data(cfg)
    train_idx, val_idx = split(len(y), cfg)
    x_train, y_train = x[train_idx].to(device), y[train_idx].to(device)
    x_val, y_val = x[val_idx].to(device), y[val_idx].to(device)
    per_epoch = math.ceil(len(train_idx) / cfg["batch_size"])
    total = cfg["epochs"] * per_epoch
    model = build_model(cfg, x.shape[1], len(classes)).to(device)
    optimizer, scheduler = make_optimizer(cfg, model, total)
    step = 0
    resume = runtime.resume_from()
    if resume:
        state = torch.load(resume, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        step = int(state["step"])
        print(f"resumed from {os.path.basename(resume)} at step {step}", flush=True)
    else:
        runtime.log("split", seed=cfg["seed"], n_train=len(train_idx), n_val=len(val_idx),
                    val_sha256=hashlib.sha256(val_idx.numpy().tobytes()).hexdigest())

    def checkpoint() -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": rng_state(), "step": step,
                 "epoch": step // per_epoch}

        def write(f: Any) -> None:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            f.write(buffer.getvalue())
        runtime.save_checkpoint(write, step)

    every = int(os.environ.get("TETHER_CHECKPOINT_EVERY") or 0)
    started, loss_value = time.time(), float("nan")
    while step < total:
        epoch, position = divmod(step, per_epoch)
        order = torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + epoch))
        batch = order[position * cfg["batch_size"]:(position + 1) * cfg["batch_size"]].to(device)
        tick = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        loss_value = loss.item()
        runtime.log("step", step=step, total_steps=total, epoch=epoch + 1, loss=round(loss_value, 6),
                    lr=scheduler.get_last_lr()[0], samples_per_s=round(len(batch) / (time.perf_counter() - tick), 1))
        if step % per_epoch == 0:
            val_loss, val_accuracy = evaluate(model, x_val, y_val)
            runtime.log("epoch", step=step, epoch=epoch + 1, val_loss=round(val_loss, 6),
                        val_accuracy=round(val_accuracy, 6))
        if (every and step % every == 0) or stop.requested:
            checkpoint()
        if stop.requested and step < total:
            print(f"{stop.signal_name}: checkpointed at step {step}; exiting to be resumed", flush=True)
            sys.exit(runtime.PREEMPTED_EXIT)
    finish(cfg, model, x_val, y_val, classes, train_idx, val_idx, step, loss_value, started, device)


def finish(cfg: dict, model: nn.Module, x_val: torch.Tensor, y_val: torch.Tensor, classes: list[str],
           train_idx: torch.Tensor, val_idx: torch.Tensor, step: int, loss_value: float, started: float,
           device: torch.device) -> None:
    out = os.environ["TETHER_ARTIFACTS_DIR"]
    val_loss, val_accuracy = evaluate(model, x_val, y_val)
    model_path = save_model(model, out)
    metrics = {"val_accuracy": val_accuracy, "val_loss": val_loss, "train_loss_last": loss_value,
               "steps": step, "epochs": cfg["epochs"], "classes": len(classes)}
    resolved = dict(cfg, classes=classes, device=str(device), torch=torch.__version__,
                    split={"seed": cfg["seed"], "val_fraction": cfg["val_fraction"],
                           "train": train_idx.tolist(), "val": val_idx.tolist()})
    for name, content in (("metrics.json", metrics), ("config.json", resolved)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)
    print(f"done: {step} steps, val_accuracy {val_accuracy:.4f}, wrote {os.path.basename(model_path)} "
          f"({time.time() - started:.1f}s this attempt)", flush=True)


if __name__ == "__main__":
    main()
