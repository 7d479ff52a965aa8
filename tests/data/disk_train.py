"""A public-style PyTorch script: its own checkpoint file (out/ckpt.pt), a --resume flag, print output."""

import argparse
import csv
import json
import os

import torch


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    x = torch.tensor([[float(r["x1"]), float(r["x2"])] for r in rows])
    y = torch.tensor([[float(r["label"])] for r in rows])
    return x, y


def save(state, path, in_place):
    if in_place:  # what many scripts do: the old checkpoint is gone the moment this starts
        torch.save(state, path)
        return
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume", default="")
    parser.add_argument("--in-place", action="store_true")
    parser.add_argument("--grow", type=int, default=1 << 20, help="bytes of history kept per epoch")
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y = load("demo/points.csv")
    model = torch.nn.Linear(2, 1)
    lr = 0.1  # plain SGD by hand: torch.optim's first use costs seconds of imports, and SGD keeps no state
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        start = ckpt["epoch"]
        print("resumed from %s at epoch %d" % (args.resume, start), flush=True)
    os.makedirs("out", exist_ok=True)
    for epoch in range(start, args.epochs):
        model.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        history = torch.full((args.grow // 4 * (epoch + 1),), loss.item())  # a per-step log that grows
        save({"model": model.state_dict(), "epoch": epoch + 1, "history": history},
             "out/ckpt.pt", args.in_place)
        print("epoch %d loss %.6f saved out/ckpt.pt" % (epoch + 1, loss.item()), flush=True)
    with open("out/final.json", "w") as f:
        json.dump({"weight": model.weight.tolist(), "bias": model.bias.tolist()}, f, sort_keys=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
