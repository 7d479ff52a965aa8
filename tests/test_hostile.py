"""Hostile and unlucky input, as data: each case is an input that once lost, leaked or wedged
something, the one-line error (or safe outcome) it now gets, and proof that what it threatened
is intact afterwards.

One section per area; each section's cases are a table of `pytest.param`s.
"""

from __future__ import annotations

import pytest  # noqa: F401


# ================================================================ remote_dir ownership and prune


# (end of section: remote_dir ownership and prune)


# ================================================================ seal, artifacts, launcher failures


# (end of section: seal, artifacts, launcher failures)


# ================================================================ GPUs and SLURM guards

# The GPU cases replay real captured nvidia-smi output (tests/data/nvidia-smi/SOURCES.md says whose)
# through a stand-in `nvidia-smi` first on PATH, and run the far side's real preflight code on it;
# the SLURM cases are configs, checked by Config as `doit validate` does, against sbatch's own
# option table (which test_sbatch_option_table_is_the_installed_sbatchs compares with the real one).

import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

from tether.backends.base import Report, _gpu_items  # noqa: E402
from tether.backends.slurm import (OWN_OPTIONS, SBATCH_LONG, SBATCH_NO_ARG, SBATCH_REQUIRED_ARG, Config,  # noqa: E402
                                   sbatch_words)
from tether.remote import machine  # noqa: E402

NVIDIA_SMI_DATA = Path(__file__).resolve().parent / "data" / "nvidia-smi"
NVIDIA_SMI_STAND_IN = """\
#!/bin/sh
# A stand-in for nvidia-smi (no GPU here): replays real captured output, see {data}/SOURCES.md
case "$*" in
  "{memory_query}") cat {data}/{memory}; exit {code} ;;
  "{capability_query}") cat {data}/{capability}; exit {code} ;;
esac
echo "stand-in nvidia-smi: no captured output for: $*" >&2
exit 2
"""
# Real torch.cuda.get_arch_list() of stock builds (SOURCES.md, "torch arch lists").
CU126 = {"torch": "2.7.0+cu126", "cuda": "12.6", "arch_list": "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90".split()}
CU128 = {"torch": "2.7.0+cu128", "cuda": "12.8", "arch_list": "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120".split()}
CU102 = {"torch": "1.7.1", "cuda": "10.2", "arch_list": "sm_35 sm_37 sm_50 sm_60 sm_61 sm_70 sm_75".split()}
CU80 = {"torch": "1.0.1", "cuda": "8.0", "arch_list": "sm_35 sm_37 sm_50 sm_52 sm_53 sm_60 sm_61".split()}
CPU_ONLY = {"torch": "2.13.0+cpu", "cuda": None, "arch_list": []}


@pytest.fixture
def replay_nvidia_smi(tmp_path, monkeypatch):
    """replay(memory, code, capability): nvidia-smi on PATH now prints those captured files and exits `code`."""
    def replay(memory: str, code: int = 0, capability: str = "query-gpu-compute_cap.txt") -> None:
        folder = tmp_path / "bin"
        folder.mkdir(exist_ok=True)
        script = folder / "nvidia-smi"
        script.write_text(NVIDIA_SMI_STAND_IN.format(
            data=NVIDIA_SMI_DATA, memory=memory, capability=capability, code=code,
            memory_query=" ".join(machine.GPU_QUERY[1:]), capability_query=" ".join(machine.CAPABILITY_QUERY[1:])))
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return replay


def gpu_lines(found: dict, settings: dict) -> dict:
    """The preflight's GPU lines, by name, as `doit check` shows them."""
    report = Report("lab")
    _gpu_items(report, found, settings)
    return {item["check"]: item for item in report.items}


# replayed output, its exit code, gpus:, min_free_gpu_mb, whether check passes, what its gpu line
# says, and what a launch gets (the launcher's gpu_env: CUDA_VISIBLE_DEVICES, or its one-line error)
NVIDIA_SMI_CASES = [
    pytest.param("no-devices.txt", 6, "auto", 2000, True,
                 "no usable GPU (nvidia-smi exited 6: No devices were found): the trainer runs on the CPU", {},
                 id="no-devices-trains-on-cpu"),
    pytest.param("driver-failure.txt", 9, "auto", 2000, True,
                 "no usable GPU (nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate with "
                 "the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.): the "
                 "trainer runs on the CPU", {}, id="driver-failure-trains-on-cpu"),
    pytest.param("no-devices.txt", 6, "0", 2000, False,
                 "gpus '0' names GPUs, but nvidia-smi exited 6: No devices were found: fix the driver, or set "
                 "gpus: auto to train on the CPU", {"CUDA_VISIBLE_DEVICES": "0"}, id="no-devices-but-gpus-named"),
    pytest.param("nvml-mismatch.txt", 18, "auto", 2000, False,
                 "nvidia-smi exited 18: Failed to initialize NVML: Driver/library version mismatch NVML library "
                 "version: 535.161: make nvidia-smi work on the far side, or set gpus: none",
                 "Failed to initialize NVML: Driver/library version mismatch", id="other-failures-say-why"),
    pytest.param("query-gpu-memory-gb10.txt", 0, "auto", 2000, False,
                 "no GPU has 2000 MB free (0: free memory unknown): wait, lower min_free_gpu_mb (0 accepts a GPU "
                 "whose free memory nvidia-smi cannot report), or set gpus:",
                 "no GPU has 2000 MB free (0: free memory unknown)", id="na-memory-is-unknown-not-a-crash"),
    pytest.param("query-gpu-memory-gb10.txt", 0, "auto", 0, True,
                 "0: NVIDIA GB10, free memory unknown ([N/A]), 0% busy; a run gets CUDA_VISIBLE_DEVICES=0",
                 {"CUDA_VISIBLE_DEVICES": "0"}, id="na-memory-accepted-when-nothing-asked"),
    pytest.param("query-gpu-memory-util-na.txt", 0, "auto", 1000, True,
                 "0: NVIDIA RTX A4000, 932/16376 MB free, utilization unknown; 1: NVIDIA RTX A5000, 9087/24564 MB "
                 "free, utilization unknown; a run gets CUDA_VISIBLE_DEVICES=1",
                 {"CUDA_VISIBLE_DEVICES": "1"}, id="na-utilization-is-unknown-not-a-crash"),
]


@pytest.mark.parametrize("output, code, gpus, min_free, ok, detail, launch", NVIDIA_SMI_CASES)
def test_nvidia_smi_edge_cases(replay_nvidia_smi, tmp_path, output, code, gpus, min_free, ok, detail, launch):
    replay_nvidia_smi(output, code, capability=output if code else "query-gpu-compute_cap.txt")
    settings = {"remote_dir": str(tmp_path / "far"), "gpus": gpus, "min_free_gpu_mb": min_free}
    found = machine.check(settings)  # the far side's real preflight
    line = gpu_lines(found, settings)["gpu"]
    assert (line["ok"], line["detail"]) == (ok, detail), found
    if isinstance(launch, dict):
        assert machine.gpu_env(settings) == launch  # what the launcher starts the trainer with
    else:
        with pytest.raises(ValueError, match=re.escape(launch)):
            machine.gpu_env(settings)


# torch's probe on the far side, GPUs replayed from the captures (query-gpu-memory.txt: GPU 1 has the
# most free memory; query-gpu-compute_cap.txt: GPU 0 is sm_70, GPU 1 sm_89), whether the host is
# accepted, which GPUs are usable, what the torch line says, and the GPU a run gets (at check and launch)
TORCH_KERNEL_CASES = [
    pytest.param(CU126, True, [0, 1], ["torch 2.7.0+cu126 (CUDA 12.6) has kernels for these GPUs"], "1",
                 id="sm_89-runs-the-stock-sm_86-cubin"),
    pytest.param(CU128, True, [1], ["has kernels for GPU(s) 1; skipped: 0 (sm_70): torch's arch list "
                                    "(sm_75, sm_80, sm_86, sm_90, sm_100, sm_120) has nothing for sm_70"], "1",
                 id="one-gpu-without-kernels-is-skipped"),
    pytest.param(CU102, True, [0], ["has kernels for GPU(s) 0; skipped: 1 (sm_89)"], "0",
                 id="the-freest-gpu-without-kernels-is-not-chosen"),
    pytest.param(CU80, False, [], ["has kernels for no GPU here: 0 (sm_70): ", "1 (sm_89): ",
                                   "install a torch build for these GPUs"], "1", id="no-gpu-has-kernels-refuses"),
    pytest.param(CPU_ONLY, False, [], ["0 (sm_70): torch 2.13.0+cpu is a CPU-only build; 1 (sm_89): torch "
                                       "2.13.0+cpu is a CPU-only build"], "1", id="cpu-only-torch-refuses"),
]


@pytest.mark.parametrize("probe, ok, usable, details, chosen", TORCH_KERNEL_CASES)
def test_torch_kernels_per_gpu(replay_nvidia_smi, tmp_path, probe, ok, usable, details, chosen):
    replay_nvidia_smi("query-gpu-memory.txt")
    settings = {"remote_dir": str(tmp_path), "gpus": "auto", "min_free_gpu_mb": 900}
    found = machine.gpu_check(settings, torch_needed=True, torch_probe=probe)
    assert found["torch"]["usable"] == usable, found
    lines = gpu_lines(found, settings)
    assert lines["torch kernels"]["ok"] is ok, lines
    for detail in details:
        assert detail in lines["torch kernels"]["detail"], lines
    assert lines["gpu"]["ok"] and lines["gpu"]["detail"].endswith(f"a run gets CUDA_VISIBLE_DEVICES={chosen}"), lines
    assert machine.gpu_env(settings) == {"CUDA_VISIBLE_DEVICES": chosen}  # the launch, which does not probe torch
    machine.gpu_check(settings, torch_needed=False)  # a trainer without torch: no GPU is skipped any more
    assert machine.gpu_env(settings) == {"CUDA_VISIBLE_DEVICES": "1"}


# torch's rule, one GPU at a time: compute capability, arch list, the entry that runs it (None: none)
KERNEL_RULE_CASES = [
    pytest.param((8, 9), CU126["arch_list"], "sm_86", id="sm_89-gets-sm_86"),
    pytest.param((8, 6), CU126["arch_list"], "sm_86", id="exact"),
    pytest.param((8, 0), ["sm_86"], None, id="a-newer-minor-cubin-does-not-run-on-an-older-gpu"),
    pytest.param((9, 0), ["sm_86"], None, id="cubins-stay-within-their-major"),
    pytest.param((12, 1), CU128["arch_list"], "sm_120", id="gb10-sm_121-gets-sm_120"),
    pytest.param((9, 0), ["sm_80", "compute_80"], "compute_80", id="ptx-is-jit-compiled-for-newer-gpus"),
    pytest.param((8, 0), ["compute_86"], None, id="ptx-not-for-older-gpus"),
    pytest.param((9, 0), ["sm_90a"], "sm_90a", id="arch-specific-on-its-gpu"),
    pytest.param((10, 3), ["sm_100a"], None, id="arch-specific-nowhere-else"),
    pytest.param((8, 9), [], None, id="empty-arch-list"),
]


@pytest.mark.parametrize("capability, arch_list, expected", KERNEL_RULE_CASES)
def test_torch_kernel_rule(capability, arch_list, expected):
    assert machine.kernel_for(capability, arch_list) == expected


# sbatch_options, and the one-line error each gets from `doit validate` (None: accepted)
SBATCH_OPTION_CASES = [
    pytest.param(("--out=x",), "'--out=x' is set by tether itself (sbatch reads it as --output)", id="long-prefix"),
    pytest.param(("--outp", "x"), "'--outp x' is set by tether itself (sbatch reads it as --output)",
                 id="long-prefix-value-apart"),
    pytest.param(("-D/",), "'-D/' is set by tether itself (sbatch reads it as --chdir)", id="short-value-attached"),
    pytest.param(("-ofile",), "'-ofile' is set by tether itself (sbatch reads it as --output)", id="short-o-attached"),
    pytest.param(("-HD/",), "'-HD/' is set by tether itself (sbatch reads it as --chdir)", id="short-bunched"),
    pytest.param(("--chd=/elsewhere",), "'--chd=/elsewhere' is set by tether itself (sbatch reads it as --chdir): "
                 "remove it: the job starts in its run dir",
                 id="chdir-prefix"),
    pytest.param(("--job=mine",), "'--job=mine' is set by tether itself (sbatch reads it as --job-name): set job_name: "
                 "instead", id="job-name-prefix"),
    pytest.param(("--pars",), "'--pars' is set by tether itself (sbatch reads it as --parsable)", id="parsable-prefix"),
    pytest.param(("--sig=USR1@5",), "'--sig=USR1@5' is set by tether itself (sbatch reads it as --signal): set "
                 "signal_grace_s: instead", id="signal-prefix"),
    pytest.param(("-t", "5"), "'-t 5' is set by tether itself (sbatch reads it as --time): set time: instead",
                 id="time-overrides-the-time-key"),
    pytest.param(("--no-requeue",), "'--no-requeue' is set by tether itself: remove it: the restart policy",
                 id="no-requeue"),
    pytest.param(("--o=x",), "'--o=x' is ambiguous: sbatch reads it as one of --open-mode, --output, --overcommit, "
                 "--oversubscribe; write the option in full", id="ambiguous-prefix"),
    pytest.param(("--acount=ml",), "'--acount=ml' is not an sbatch option (did you mean --account", id="unknown-long"),
    pytest.param(("-X",), "'-X': -X is not an sbatch option", id="unknown-short"),
    pytest.param(("--account",), "'--account' needs a value: --account=VALUE", id="missing-value"),
    pytest.param(("--hold=yes",), "'--hold=yes' takes no value: --hold", id="value-for-a-flag"),
    pytest.param(("gpu:1",), "'gpu:1' is not an option: write each one as --name=value", id="not-an-option"),
    pytest.param(("--gres=gpu:1",), "'--gres=gpu:1' is set by tether itself: set gres: instead", id="gres-key"),
    pytest.param(("--account=ml", "--qos=high", "-A", "ml", "--mail-type", "END", "-Hv", "--exclusive", "--nice"),
                 "'--nice' is set by tether itself: set nice: instead", id="nice-key"),
    pytest.param(("--account=ml", "--qos=high", "--gpus-per-node=2", "-A", "ml", "--mail-type", "END", "-Hv",
                  "--exclusive", "--acco=ml", "-k"), None, id="ordinary-options-pass"),
]


@pytest.mark.parametrize("options, error", SBATCH_OPTION_CASES)
def test_sbatch_options_are_resolved_as_sbatch_does(options, error):
    problems = Config(host="login", remote_dir="~/tether", sbatch_options=options).problems()
    if error is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(f"sbatch_options: {error}"), problems


# remote_dir, and whether it is refused as /tmp (which compute nodes do not share)
REMOTE_DIR_CASES = [
    pytest.param("//tmp/x", True, id="double-slash"),
    pytest.param("///tmp", True, id="triple-slash"),
    pytest.param("/var//tmp/runs", True, id="inner-double-slash"),
    pytest.param("/var/./tmp", True, id="dot"),
    pytest.param("/tmp/", True, id="trailing-slash"),
    pytest.param("//scratch/tmp/tether", False, id="shared-folder-named-tmp"),
]


@pytest.mark.parametrize("remote_dir, refused", REMOTE_DIR_CASES)
def test_remote_dir_under_tmp_is_refused_however_written(remote_dir, refused):
    problems = Config(host="login", remote_dir=remote_dir).problems()
    expected = [f"remote_dir {remote_dir!r} is under /tmp or /var/tmp, which compute nodes do not share: use a "
                f"folder on shared storage (e.g. ~/tether or /scratch/$USER/tether)"] if refused else []
    assert problems == expected


# time, signal_grace_s, and the error (None: accepted)
SIGNAL_GRACE_CASES = [
    pytest.param("00:01:00", 120, "signal_grace_s 120 is not below time 00:01:00 (60 s): the time-limit warning "
                 "would come as the job starts; lower signal_grace_s well below 60, or raise time", id="above"),
    pytest.param("2", 120, "signal_grace_s 120 is not below time 2 (120 s)", id="equal-in-plain-minutes"),
    pytest.param("00:10:00", 120, None, id="below"),
    pytest.param("1-00:00:00", 600, None, id="days"),
]


@pytest.mark.parametrize("time, grace, error", SIGNAL_GRACE_CASES)
def test_signal_grace_must_be_below_the_time_limit(time, grace, error):
    problems = Config(host="login", remote_dir="~/tether", time=time, signal_grace_s=grace).problems()
    if error is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(error), problems


def _sbatch_resolves(prefix: str, env: dict) -> str:
    """What the real sbatch's getopt_long makes of `--prefix`: a long name, 'ambiguous' or 'unknown' (or
    'accepted' for an option whose argument is optional: getopt then names nothing)."""
    def first_line(*args: str) -> str:
        done = subprocess.run(["sbatch", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env=env, timeout=30)
        return (done.stderr + done.stdout).strip().splitlines()[0]

    said = first_line(f"--{prefix}=1")
    if "is ambiguous" in said or "unrecognized option" in said:
        return "ambiguous" if "is ambiguous" in said else "unknown"
    named = re.search(r"option '--([a-z-]+)' (doesn't allow|requires)", said) or \
        re.search(r"option '--([a-z-]+)' requires", first_line(f"--{prefix}"))
    return named.group(1) if named else "accepted"


def _tether_resolves(prefix: str) -> str:
    """What Config makes of `--prefix`, in _sbatch_resolves's words."""
    found, problems = sbatch_words((f"--{prefix}=1",))
    return found[0][1] if found else ("ambiguous" if "is ambiguous" in problems[0] else "unknown")


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed here")
def test_sbatch_option_table_is_the_installed_sbatchs(tmp_path):
    """The committed table against the real sbatch: every long name (from its own "possibilities"),
    and the prefixes the cases above rely on. sbatch parses options before it needs a controller."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1 State=UNKNOWN\n"
                    "PartitionName=debug Nodes=localhost Default=YES\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    listed = set()
    for letter in "abcdefghijklmnopqrstuvwxyz":
        done = subprocess.run(["sbatch", f"--{letter}=1"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, env=env, timeout=30)
        listed |= set(re.findall(r"'--([a-z-]+)'", done.stderr.splitlines()[0])) - {f"{letter}=1"}
    singles = {name for name in SBATCH_LONG if sum(n[0] == name[0] for n in SBATCH_LONG) == 1}
    assert listed | singles == set(SBATCH_LONG)
    for prefix, expected in [("out", "output"), ("outp", "output"), ("chd", "chdir"), ("job", "job-name"),
                             ("pars", "parsable"), ("sig", "signal"), ("o", "ambiguous"), ("acount", "unknown"),
                             ("acco", "account"), ("acc", "ambiguous"), ("hold", "hold")]:
        assert (_sbatch_resolves(prefix, env), _tether_resolves(prefix)) == (expected, expected), prefix
    # each option's argument, for those whose argument decides what the next word is (a value or an option)
    for name in sorted(set(OWN_OPTIONS) | (set(SBATCH_LONG) - SBATCH_NO_ARG - SBATCH_REQUIRED_ARG)):
        assert (_sbatch_resolves(name, env) == "accepted") == (name not in SBATCH_NO_ARG | SBATCH_REQUIRED_ARG), name


# (end of section: GPUs and SLURM guards)


# ================================================================ config input and command line


# (end of section: config input and command line)


# ================================================================ pull, verify and transfers


# (end of section: pull, verify and transfers)
