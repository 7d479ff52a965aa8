"""A small real training job for the default config: logistic regression by mini-batch SGD.

Standard library only, so the default job runs anywhere Python does. It follows tether's
trainer contract: events through runtime.log, checkpoints through runtime.save_checkpoint,
resume from TETHER_RESUME_FROM without repeating or skipping a batch, and on SIGTERM/SIGUSR1
a checkpoint and exit code 75.
"""

import argparse
import csv
import json
import math
import os
import random
import sys

from tether.trainers import runtime


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [([float(r["x1"]), float(r["x2"])], int(r["label"])) for r in rows]


def batch_grad(w, b, batch):
    gw, gb, loss = [0.0, 0.0], 0.0, 0.0
    for x, y in batch:
        z = w[0] * x[0] + w[1] * x[1] + b
        p = 1.0 / (1.0 + math.exp(-z))
        loss -= math.log(p if y else 1.0 - p)
        gw[0] += (p - y) * x[0]
        gw[1] += (p - y) * x[1]
        gb += p - y
    n = len(batch)
    return [g / n for g in gw], gb / n, loss / n


def accuracy(w, b, data):
    hits = sum((w[0] * x[0] + w[1] * x[1] + b > 0) == bool(y) for x, y in data)
    return hits / len(data)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stop = runtime.stop_signal()
    data = load(os.path.join(os.environ["TETHER_DATA_DIR"], "demo", "points.csv"))
    per_epoch = math.ceil(len(data) / args.batch)
    total = args.epochs * per_epoch
    every = int(os.environ.get("TETHER_CHECKPOINT_EVERY") or 0) or 50
    state = {"w": [0.0, 0.0], "b": 0.0, "step": 0}
    if runtime.resume_from():
        with open(runtime.resume_from()) as f:
            state = json.load(f)
    save = lambda: runtime.save_checkpoint(lambda f: f.write(json.dumps(state).encode()), state["step"])
    while state["step"] < total:
        epoch, position = divmod(state["step"], per_epoch)
        order = list(range(len(data)))
        random.Random(args.seed * 100003 + epoch).shuffle(order)  # the order is a function of the epoch
        batch = [data[i] for i in order[position * args.batch:(position + 1) * args.batch]]
        gw, gb, loss = batch_grad(state["w"], state["b"], batch)
        state["w"] = [w - args.lr * g for w, g in zip(state["w"], gw)]
        state["b"] -= args.lr * gb
        state["step"] += 1
        runtime.log("step", step=state["step"], total_steps=total, loss=round(loss, 6), lr=args.lr)
        if state["step"] % per_epoch == 0:
            runtime.log("epoch", step=state["step"], epoch=epoch + 1, accuracy=accuracy(state["w"], state["b"], data))
        if state["step"] % every == 0:
            save()
        if stop.requested:
            save()
            print("stop requested (%s): checkpointed at step %d" % (stop.signal_name, state["step"]))
            sys.exit(runtime.PREEMPTED_EXIT)
    out = os.environ["TETHER_ARTIFACTS_DIR"]
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump({"w": state["w"], "b": state["b"]}, f)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump({"accuracy": accuracy(state["w"], state["b"], data), "steps": state["step"]}, f)
    print("done: %d steps, accuracy %.3f" % (state["step"], accuracy(state["w"], state["b"], data)))


if __name__ == "__main__":
    main()
