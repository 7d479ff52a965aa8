"""What a preflight learns about the far side, on the far side: Python, disk, GPUs, modules.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from tether.remote.fileio import atomic_write_json, read_json

OLDEST_PYTHON = (3, 8)  # the oldest the far side supports; tests/test_far_package.py imports all of it there
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.free,utilization.gpu",
             "--format=csv,noheader,nounits"]
CAPABILITY_QUERY = ["nvidia-smi", "--query-gpu=index,compute_cap", "--format=csv,noheader"]
TORCH_PROBE = ("import json, torch; print(json.dumps({'torch': torch.__version__, "
               "'cuda': torch.version.cuda, 'arch_list': torch.cuda.get_arch_list()}))")
# nvidia-smi(1), RETURN VALUE: 6 "A query to find an object was unsuccessful" (it prints "No devices
# were found"), 9 "NVIDIA driver is not loaded". Both mean: this host has no GPU to use, so a run
# trains on the CPU. Every other failure (permissions, a GPU fallen off the bus, ...) is an error.
NO_GPU_EXITS = {6: "no GPU found", 9: "the NVIDIA driver is not loaded"}
# Under remote_dir: which GPUs the last preflight found torch kernels for, so that a launch (which
# does not import torch) skips the same GPUs the preflight said it would.
KERNELS_FILE = "gpu-kernels.json"
NVIDIA_SMI_FIX = "%s: make nvidia-smi work on the far side, or set gpus: none"
# A CUDA arch as torch.cuda.get_arch_list() names it: sm_86 (a cubin), compute_90 (PTX), sm_90a
# (arch-specific: that exact GPU only), sm_100f (family: the same major version).
ARCH_RE = re.compile(r"(sm|compute)_(\d+)([af]?)")


class CommandFailed(RuntimeError):
    """A far-side program exited non-zero; `said` is what it printed (stderr, else stdout)."""

    def __init__(self, program: str, code: int, said: str) -> None:
        super().__init__("%s exited %d: %s" % (program, code, said))
        self.code = code
        self.said = said


class NoGpu(Exception):
    """nvidia-smi ran and says this host has no usable GPU (no device, or no driver)."""


def _run(argv: List[str], timeout: float = 30) -> Optional[str]:
    """stdout of `argv`, or None when the program is not installed."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return None
    if done.returncode != 0:
        # nvidia-smi prints its reasons ("No devices were found") on stdout, not stderr
        said = " ".join((done.stderr.strip() or done.stdout.strip()).split())[-300:]
        raise CommandFailed(argv[0], done.returncode, said)
    return done.stdout


def _number(text: str, line: str) -> Optional[int]:
    """A number nvidia-smi printed, or None for the `[N/A]` / `[Not Supported]` of a value this GPU cannot report."""
    if text.startswith("[") and text.endswith("]"):
        return None
    try:
        return int(float(text))
    except ValueError:
        raise RuntimeError("nvidia-smi printed %r, not index, name, memory, utilization" % line) from None


def gpus() -> Optional[List[Dict[str, Any]]]:
    """The GPUs nvidia-smi reports (index, name, memory in MB, utilization %; None where it says [N/A]),
    or None without nvidia-smi; NoGpu when nvidia-smi says there is none."""
    try:
        out = _run(GPU_QUERY)
    except CommandFailed as err:
        if err.code in NO_GPU_EXITS:
            raise NoGpu("nvidia-smi exited %d: %s" % (err.code, err.said or NO_GPU_EXITS[err.code])) from None
        raise
    if out is None:
        return None
    found = []
    for line in out.strip().splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 5:
            raise RuntimeError("nvidia-smi printed %r, not index, name, memory, utilization" % line)
        index, name, total, free, util = parts
        found.append({"index": int(index), "name": name, "memory_total_mb": _number(total, line),
                      "memory_free_mb": _number(free, line), "utilization_pct": _number(util, line)})
    return found


def gpu_env(settings: Dict[str, Any]) -> Dict[str, str]:
    """CUDA_VISIBLE_DEVICES a launch would get now (leases read, none taken); ValueError with the
    one-line reason when the run could not have its GPUs (tether.remote.gpuchoice decides)."""
    from tether.remote import gpuchoice

    found, no_gpu = gpuchoice.looked_up(settings)
    ask = gpuchoice.Ask.of(settings)
    leased = gpuchoice.leased_to(settings["remote_dir"]) if found and settings.get("remote_dir") else {}
    kernels = gpuchoice.no_kernels_remembered(settings, found) if found and settings.get("remote_dir") else {}
    choice = gpuchoice.choose(ask, found, no_gpu, kernels, leased)
    if choice.error:
        raise ValueError(choice.error)
    return choice.env()


def _gpu_identity(found: List[Dict[str, Any]]) -> List[List[Any]]:
    return [[g["index"], g["name"]] for g in found]


def _remember_usable(remote_dir: str, found: List[Dict[str, Any]], usable: Optional[Set[int]],
                     reasons: Optional[Dict[int, str]] = None) -> None:
    """Record the preflight's usable GPUs (and why the others are not) for later launches; no verdict
    (torch not needed) removes an old one."""
    path = os.path.join(remote_dir, KERNELS_FILE)
    if usable is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    atomic_write_json(path, {"gpus": _gpu_identity(found), "usable": sorted(usable),
                             "reasons": {str(i): why for i, why in (reasons or {}).items()}})


def _remembered_usable(settings: Dict[str, Any], found: List[Dict[str, Any]]) -> Optional[Set[int]]:
    """The usable GPUs the last preflight recorded, if it saw these same GPUs; else None (all usable)."""
    try:
        record = read_json(os.path.join(settings["remote_dir"], KERNELS_FILE)) if settings.get("remote_dir") else None
    except ValueError:  # a damaged record decides nothing
        record = None
    if not isinstance(record, dict) or record.get("gpus") != _gpu_identity(found):
        return None
    return set(record.get("usable", []))


def kernel_for(capability: Tuple[int, int], arch_list: Sequence[str]) -> Optional[str]:
    """The entry of torch's arch list that runs on a GPU of this compute capability, or None.

    torch's own rule (torch/cuda/__init__.py, `_check_capability` and `_code_compatible_with_device`,
    torch 2.13): a cubin sm_XY runs on the GPUs of major X with minor >= Y, so a stock wheel's sm_86
    serves an sm_89 (RTX 40xx, L4, L40; pytorch/pytorch#95648); PTX compute_XY is JIT-compiled for
    any GPU at or above X.Y (CUDA's forward compatibility); sm_XYa runs on X.Y only.
    """
    fitting = []
    for arch in arch_list:
        match = ARCH_RE.fullmatch(arch)
        if not match:
            continue
        kind, digits, suffix = match.groups()
        built = (int(digits[:-1]), int(digits[-1]))
        if suffix == "a":
            fits = built == capability
        elif kind == "sm":
            fits = built[0] == capability[0] and built[1] <= capability[1]
        else:
            fits = built <= capability
        if fits:
            fitting.append((kind == "sm", built, arch))
    return max(fitting)[2] if fitting else None  # a ready cubin before PTX, the newest that fits


def _capabilities() -> Dict[int, Optional[Tuple[int, int]]]:
    """Each GPU's compute capability (8.9 -> (8, 9)); None where nvidia-smi cannot tell."""
    try:
        out = _run(CAPABILITY_QUERY) or ""
    except CommandFailed:
        return {}  # a driver too old for the compute_cap field: capabilities unknown, nothing refused
    found: Dict[int, Optional[Tuple[int, int]]] = {}
    for line in out.strip().splitlines():
        index, _, cap = [part.strip() for part in line.partition(",")]
        major, dot, minor = cap.partition(".")
        found[int(index)] = (int(major), int(minor)) if dot and major.isdigit() and minor.isdigit() else None
    return found


def _judge(gpu: Dict[str, Any], capability: Optional[Tuple[int, int]], info: Dict[str, Any]) -> Dict[str, Any]:
    """Whether torch has kernels for one GPU: {index, capability, kernels (the arch used) or None, ok, reason}."""
    verdict: Dict[str, Any] = {"index": gpu["index"], "name": gpu["name"], "kernels": None}
    if capability is None:
        return dict(verdict, capability=None, ok=True, reason="compute capability unknown: not checked")
    verdict["capability"] = "sm_%d%d" % capability
    if not info.get("cuda"):
        return dict(verdict, ok=False, reason="torch %s is a CPU-only build" % info["torch"])
    arch = kernel_for(capability, info.get("arch_list") or [])
    if arch is None:
        built = ", ".join(info.get("arch_list") or []) or "none (torch sees no CUDA device)"
        reason = "torch's arch list (%s) has nothing for %s" % (built, verdict["capability"])
        return dict(verdict, ok=False, reason=reason)
    return dict(verdict, kernels=arch, ok=True, reason="runs %s" % arch)


def torch_kernels(found: List[Dict[str, Any]], info: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Whether this Python's torch has kernels for each of these GPUs; `usable` lists those that do.

    `info`: what TORCH_PROBE prints (torch, cuda, arch_list), if already known; else it is run here."""
    if info is None:
        try:
            probe = _run([sys.executable, "-c", TORCH_PROBE], timeout=120)
        except RuntimeError:
            return {"torch": None}
        info = json.loads(probe) if probe else {"torch": None}
    return kernels_per_gpu(found, info, _capabilities()) if info.get("torch") else info


def kernels_per_gpu(found: List[Dict[str, Any]], info: Dict[str, Any],
                    capabilities: Dict[int, Optional[Tuple[int, int]]]) -> Dict[str, Any]:
    """torch's probe (version, cuda, arch_list) plus a verdict per GPU and `usable`, the GPUs it has kernels for."""
    verdicts = [_judge(g, capabilities.get(g["index"]), info) for g in found]
    return dict(info, gpus=verdicts, usable=[v["index"] for v in verdicts if v["ok"]])


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
    """The preflight: Python, disk and inodes under remote_dir, GPUs and the chosen one, modules.

    Asked of the run's interpreter (settings' `python`): when that is not this one (a venv built
    from it), the same check runs there, so the modules found are the ones the trainer will see.
    """
    python = settings.get("python")
    if python and not _is_this_python(python):
        return _check_with(python, dict(settings, python=None))
    remote_dir = settings["remote_dir"]
    from tether.remote.owner import claim

    claim(remote_dir)  # creates remote_dir, or refuses a folder tether does not own
    fs = os.statvfs(remote_dir)
    report = {"python": "%d.%d.%d" % sys.version_info[:3], "python_ok": sys.version_info >= OLDEST_PYTHON,
              "executable": sys.executable, "writable": _writable(remote_dir),
              "free_mb": fs.f_bavail * fs.f_frsize // (1 << 20), "free_inodes": fs.f_favail,
              "host": os.uname()[1],
              "missing_modules": [m for m in settings.get("require", []) if importlib.util.find_spec(m) is None]}
    if settings.get("scheduler") == "slurm":
        from tether.remote import scheduler

        report["slurm"] = scheduler.check(settings)
    if str(settings.get("gpus", "none")) != "none":
        torch_needed = "torch" in settings.get("require", []) and not report["missing_modules"]
        report.update(gpu_check(settings, torch_needed))
    return report


def _is_this_python(python: str) -> bool:
    found = shutil.which(python)
    return found is not None and os.path.abspath(found) == os.path.abspath(sys.executable)


def _check_with(python: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """The preflight asked of another interpreter (one more Python start, for `check` only)."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = ("import json, sys; sys.path.insert(0, %r); from tether.remote import machine; "
              "print(json.dumps(machine.check(json.loads(sys.stdin.read()))))" % package)
    try:
        done = subprocess.run([python, "-c", script], input=json.dumps(settings), capture_output=True, text=True,
                              timeout=600)
    except FileNotFoundError:
        raise ValueError("%s: no such interpreter on the far side" % python) from None
    if done.returncode != 0:
        raise ValueError("%s exited %d: %s" % (python, done.returncode, done.stderr.strip()[-500:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_check(settings: Dict[str, Any], torch_needed: bool,
              torch_probe: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The GPU part of a preflight: gpus, no_gpu (why there is none), torch (kernels per GPU), and the
    GPUs a run would get now (gpu_env, gpu_skipped with each reason) or why it could not (gpu_error).

    `torch_probe`: torch's version, CUDA and arch list, if known (else torch_kernels asks this Python)."""
    from tether.remote import gpuchoice

    try:
        found, no_gpu = gpuchoice.looked_up(settings)
    except ValueError as err:
        return {"gpu_error": str(err)}
    result: Dict[str, Any] = dict({"gpus": found}, **({"no_gpu": no_gpu} if no_gpu else {}))
    usable, no_kernels = None, {}  # type: Optional[Set[int]], Dict[int, str]
    if found and torch_needed:
        result["torch"] = torch_kernels(found, torch_probe)
        usable = set(result["torch"].get("usable", [g["index"] for g in found]))  # a GPU without kernels is skipped
        no_kernels = {v["index"]: v["reason"] for v in result["torch"].get("gpus", []) if not v["ok"]}
    remote_dir = settings.get("remote_dir")
    if remote_dir:
        _remember_usable(remote_dir, found or [], usable, no_kernels)
    leased = gpuchoice.leased_to(remote_dir) if found and remote_dir else {}
    choice = gpuchoice.choose(gpuchoice.Ask.of(settings), found, no_gpu, no_kernels, leased)
    result.update(gpu_env=choice.env(), gpu_skipped={str(i): why for i, why in choice.skipped.items()})
    if choice.error:
        result["gpu_error"] = choice.error
    return result
