"""What a preflight learns about the far side, on the far side: Python, disk, GPUs, modules.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

GPU_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.free,utilization.gpu",
             "--format=csv,noheader,nounits"]
CAPABILITY_QUERY = ["nvidia-smi", "--query-gpu=index,compute_cap", "--format=csv,noheader"]
TORCH_PROBE = ("import json, torch; print(json.dumps({'torch': torch.__version__, "
               "'cuda': torch.version.cuda, 'arch_list': torch.cuda.get_arch_list()}))")


def _run(argv: List[str], timeout: float = 30) -> Optional[str]:
    """stdout of `argv`, or None when the program is not installed."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return None
    if done.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (argv[0], done.returncode, done.stderr.strip()[-300:]))
    return done.stdout


def gpus() -> Optional[List[Dict[str, Any]]]:
    """The GPUs nvidia-smi reports (index, name, memory in MB, utilization %), or None without it."""
    out = _run(GPU_QUERY)
    if out is None:
        return None
    found = []
    for line in out.strip().splitlines():
        index, name, total, free, util = [part.strip() for part in line.split(",")]
        found.append({"index": int(index), "name": name, "memory_total_mb": int(total),
                      "memory_free_mb": int(free), "utilization_pct": int(util)})
    return found


def choose_gpu(found: List[Dict[str, Any]], min_free_mb: int) -> Optional[Dict[str, Any]]:
    """The GPU with the most free memory, if it has at least `min_free_mb`."""
    best = max(found, key=lambda g: (g["memory_free_mb"], -g["utilization_pct"]), default=None)
    return best if best and best["memory_free_mb"] >= min_free_mb else None


def gpu_env(settings: Dict[str, Any]) -> Dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a launch; ValueError naming the GPUs when none is free enough."""
    wanted = str(settings.get("gpus", "none"))
    if wanted == "none":
        return {}
    if wanted != "auto":
        return {"CUDA_VISIBLE_DEVICES": wanted}
    found = gpus()
    if not found:
        return {}  # no nvidia-smi or no GPU: the trainer runs on the CPU
    need = int(settings.get("min_free_gpu_mb", 0))
    chosen = choose_gpu(found, need)
    if chosen is None:
        seen = ", ".join("%d: %s MB free" % (g["index"], g["memory_free_mb"]) for g in found)
        raise ValueError("no GPU has %d MB free (%s): wait, lower min_free_gpu_mb, or set gpus:" % (need, seen))
    return {"CUDA_VISIBLE_DEVICES": str(chosen["index"])}


def torch_kernels(found: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Whether this Python's torch has kernels for these GPUs (compute capabilities)."""
    try:
        probe = _run([sys.executable, "-c", TORCH_PROBE], timeout=120)
    except RuntimeError:
        return {"torch": None}
    info = json.loads(probe) if probe else {"torch": None}
    capabilities = {}
    for line in (_run(CAPABILITY_QUERY) or "").strip().splitlines():
        index, cap = [part.strip() for part in line.split(",")]
        capabilities[int(index)] = "sm_" + cap.replace(".", "")
    info["unsupported"] = sorted({c for c in capabilities.values() if c not in info.get("arch_list", [])})
    return info


def _writable(folder: str) -> bool:
    probe = os.path.join(folder, ".write-test-%d" % os.getpid())
    try:
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
        return True
    except OSError:
        return False


def check(settings: Dict[str, Any]) -> Dict[str, Any]:
    """The preflight: Python, disk and inodes under remote_dir, GPUs and the chosen one, modules."""
    remote_dir = settings["remote_dir"]
    from tether.remote.owner import claim

    claim(remote_dir)  # creates remote_dir, or refuses a folder tether does not own
    fs = os.statvfs(remote_dir)
    report = {"python": "%d.%d.%d" % sys.version_info[:3], "python_ok": sys.version_info >= (3, 8),
              "executable": sys.executable, "writable": _writable(remote_dir),
              "free_mb": fs.f_bavail * fs.f_frsize // (1 << 20), "free_inodes": fs.f_favail,
              "host": os.uname()[1],
              "missing_modules": [m for m in settings.get("require", []) if importlib.util.find_spec(m) is None]}
    if settings.get("scheduler") == "slurm":
        from tether.remote import scheduler

        report["slurm"] = scheduler.check(settings)
    if str(settings.get("gpus", "none")) != "none":
        try:
            report["gpus"] = gpus()
            report["gpu_env"] = gpu_env(settings)
        except (RuntimeError, ValueError) as err:
            report["gpu_error"] = str(err)
        if report.get("gpus") and "torch" in settings.get("require", []) and not report["missing_modules"]:
            report["torch"] = torch_kernels(report["gpus"])
    return report
