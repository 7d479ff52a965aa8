"""GPU counts, min_gpus, pinned and skipped GPUs, and leases, against replayed real nvidia-smi output.

No GPU exists here: a stand-in `nvidia-smi` first on PATH prints the captures in tests/data/nvidia-smi/
(SOURCES.md says whose). The choice is checked on every capture, its expected answer derived from
the file; the leases on real detached launchers sharing one remote_dir, started at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import pytest

from backend_contract import wait_for
from helpers import NVIDIA_SMI_DATA, group, preflight_lines, replay_nvidia_smi
from tether.config import load
from tether.errors import ConfigError
from tether.remote import gpuchoice, launcher, leases, machine

DATA = NVIDIA_SMI_DATA
HOSTS = sorted(p.name for p in DATA.glob("query-gpu-memory*.txt") if "-na" not in p.name and "gb10" not in p.name)
CU128 = {"torch": "2.7.0+cu128", "cuda": "12.8", "arch_list": "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120".split()}
SM90_ONLY = {"torch": "2.7.0+cu128", "cuda": "12.8", "arch_list": ["sm_90"]}


@pytest.fixture
def replay(tmp_path, monkeypatch):
    """replay(memory, code, capability): nvidia-smi on PATH (here and in launchers started from here)."""
    def use(memory: str, code: int = 0, capability: str = "") -> None:
        script = replay_nvidia_smi(tmp_path / "bin", memory, code, capability or memory.replace("memory", "compute_cap"))
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return use


def captured(name: str) -> list[dict]:
    """The GPUs of a capture, read straight from the file (not through tether's parser)."""
    found = []
    for line in (DATA / name).read_text().splitlines():
        index, gpu, total, free, util = [part.strip() for part in line.split(",")]
        found.append({"index": int(index), "name": gpu, "free": int(free), "util": int(util)})
    return found


def gpu_line(found: dict, settings: dict) -> dict:
    return preflight_lines(found, settings)["gpu"]


# ---------------------------------------------------------------- the choice, on every capture


@pytest.mark.parametrize("host", HOSTS)
def test_a_count_gets_the_freest_gpus_or_says_how_many_it_found(replay, tmp_path, host):
    replay(host)
    gpus = captured(host)
    need_mb = 2000
    fit = sorted((g for g in gpus if g["free"] >= need_mb), key=lambda g: (-g["free"], g["util"], g["index"]))
    for count in range(1, len(gpus) + 2):
        settings = {"remote_dir": str(tmp_path / "far"), "gpus": count, "min_free_gpu_mb": need_mb}
        if count <= len(fit):
            expected = ",".join(str(g["index"]) for g in fit[:count])
            assert machine.gpu_env(settings) == {"CUDA_VISIBLE_DEVICES": expected}, (host, count)
            continue
        with pytest.raises(ValueError) as refused:
            machine.gpu_env(settings)
        assert str(refused.value).startswith(f"needs {count} GPU(s) with \u2265 {need_mb} MB free; found {len(fit)}")
        for g in gpus:
            if g["free"] < need_mb:
                assert f"{g['index']}: {g['free']} MB free" in str(refused.value)
        # a lower min_gpus takes what there is
        taken = machine.gpu_env(dict(settings, min_gpus=len(fit)))
        assert taken == ({"CUDA_VISIBLE_DEVICES": ",".join(str(g["index"]) for g in fit)} if fit else {})


def test_leased_gpus_are_passed_over_and_shared_ones_are_not():
    gpus = machine_gpus("query-gpu-memory-gh200x4.txt")
    freest = sorted(gpus, key=lambda g: (-g["memory_free_mb"], g["index"]))
    ask = gpuchoice.Ask.of({"gpus": 2, "min_free_gpu_mb": 2000})
    leased = {freest[0]["index"]: "r-other"}
    choice = gpuchoice.choose(ask, gpus, leased=leased)
    assert choice.indices == [freest[1]["index"], freest[2]["index"]]
    assert choice.skipped == {freest[0]["index"]: "leased to run r-other"}
    shared = gpuchoice.choose(gpuchoice.Ask.of({"gpus": 2, "min_free_gpu_mb": 2000, "share_gpus": True}), gpus,
                              leased=leased)
    assert shared.indices == [freest[0]["index"], freest[1]["index"]]


def machine_gpus(name: str) -> list[dict]:
    """The capture as tether's parser reads nvidia-smi's output."""
    return [{"index": g["index"], "name": g["name"], "memory_total_mb": None, "memory_free_mb": g["free"],
             "utilization_pct": g["util"]} for g in captured(name)]


def test_a_gpu_without_kernels_is_skipped_but_a_pinned_one_fails(replay, tmp_path):
    """query-gpu-compute_cap.txt: GPU 0 is sm_70, which CU128 has nothing for; GPU 1 (sm_89) runs its sm_86."""
    replay("query-gpu-memory.txt", capability="query-gpu-compute_cap.txt")
    settings = {"remote_dir": str(tmp_path / "far"), "gpus": 2, "min_gpus": 1, "min_free_gpu_mb": 900}
    found = machine.gpu_check(settings, torch_needed=True, torch_probe=CU128)
    line = gpu_line(found, settings)
    assert line["ok"] and "a run gets CUDA_VISIBLE_DEVICES=1 (passed over: 0: no kernels: torch's arch list" in \
        line["detail"], line
    assert machine.gpu_env(settings) == {"CUDA_VISIBLE_DEVICES": "1"}  # the launch reads the preflight's verdict
    pinned = dict(settings, gpus="0,1", min_gpus=None)
    with pytest.raises(ValueError, match=r'^gpus "0,1": GPU 0: no kernels: torch\'s arch list \(sm_75, .*\) has '
                                         r'nothing for sm_70: pin other GPUs'):
        machine.gpu_env(pinned)
    assert gpu_line(machine.gpu_check(pinned, torch_needed=True, torch_probe=CU128), pinned)["ok"] is False


def test_an_sm_89_card_runs_same_major_cubins_and_ptx_not_a_newer_major(replay, tmp_path):
    replay("query-gpu-memory-l40s.txt")
    (index, cap), = [line.split(", ") for line in (DATA / "query-gpu-compute_cap-l40s.txt").read_text().splitlines()]
    capability = tuple(int(p) for p in cap.split("."))
    assert machine.kernel_for(capability, CU128["arch_list"]) == "sm_86"
    assert machine.kernel_for(capability, ["sm_80", "compute_80"]) == "sm_80"
    assert machine.kernel_for(capability, ["compute_80"]) == "compute_80"
    settings = {"remote_dir": str(tmp_path / "far"), "gpus": "auto", "min_gpus": 1, "min_free_gpu_mb": 2000}
    found = machine.gpu_check(settings, torch_needed=True, torch_probe=SM90_ONLY)
    assert found["gpu_error"].startswith(f"needs 1 GPU(s) with \u2265 2000 MB free; found 0 ({index}: no kernels: "
                                         f"torch's arch list (sm_90) has nothing for sm_{cap.replace('.', '')})")


def test_pinned_indices_are_checked_against_nvidia_smi(replay, tmp_path):
    replay("query-gpu-memory-gh200x4.txt")
    last = max(g["index"] for g in captured("query-gpu-memory-gh200x4.txt"))
    settings = {"remote_dir": str(tmp_path / "far"), "gpus": f"0,{last + 2}", "min_free_gpu_mb": 2000}
    message = f'gpus "0,{last + 2}": this host has GPUs 0-{last} (nvidia-smi)'
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        machine.gpu_env(settings)
    line = gpu_line(machine.check(settings), settings)
    assert not line["ok"] and line["detail"].startswith(message), line
    assert machine.gpu_env(dict(settings, gpus=f"{last},0")) == {"CUDA_VISIBLE_DEVICES": f"{last},0"}


MIN_GPUS_CASES = [
    pytest.param("no-devices.txt", 6, {"gpus": "auto", "min_gpus": 1}, False,
                 "needs 1 GPU(s) with \u2265 2000 MB free; found 0 (nvidia-smi exited 6: No devices were found): make "
                 "the host's GPUs visible to nvidia-smi, or set min_gpus: 0 to train on the CPU",
                 id="rented-box-lost-gpus"),
    pytest.param("no-devices.txt", 6, {"gpus": "auto"}, True,
                 "no usable GPU (nvidia-smi exited 6: No devices were found): the trainer runs on the CPU",
                 id="auto-falls-back-to-cpu"),
    pytest.param("query-gpu-memory.txt", 0, {"gpus": 2}, False,
                 "needs 2 GPU(s) with \u2265 2000 MB free; found 1 (0: 932 MB free): wait for memory to free up (or "
                 "lower min_free_gpu_mb), or lower min_gpus", id="count-short-of-free-gpus"),
    pytest.param("query-gpu-memory.txt", 0, {"gpus": 2, "min_gpus": 1}, True,
                 "a run gets CUDA_VISIBLE_DEVICES=1 (passed over: 0: 932 MB free)", id="lower-min-takes-fewer"),
]


@pytest.mark.parametrize("output, code, keys, ok, detail", MIN_GPUS_CASES)
def test_min_gpus_in_check(replay, tmp_path, output, code, keys, ok, detail):
    replay(output, code, capability=output if code else "query-gpu-compute_cap.txt")
    settings = dict({"remote_dir": str(tmp_path / "far"), "min_free_gpu_mb": 2000}, **keys)
    line = gpu_line(machine.check(settings), settings)
    assert line["ok"] is ok and line["detail"].endswith(detail), line


CONFIG_CASES = [
    pytest.param('"0,,1"', None, 'gpus "0,,1": use auto, none, a count such as 2, or indices such as "0,1"', id="bad"),
    pytest.param("0", None, 'gpus "0": use auto, none, a count such as 2', id="zero-count"),
    pytest.param('"1,1"', None, "(each GPU once)", id="twice"),
    pytest.param("2", 3, "min_gpus 3 is more than gpus asks for (2)", id="min-above-count"),
    pytest.param("auto", 2, "min_gpus 2 is more than gpus asks for (1)", id="min-above-auto"),
    pytest.param("none", 1, "min_gpus 1 with gpus: none", id="min-with-none"),
    pytest.param('"0,1"', 1, 'min_gpus 1 with pinned gpus "0,1": every pinned GPU is needed', id="min-below-pinned"),
]


@pytest.mark.parametrize("gpus, min_gpus, message", CONFIG_CASES)
def test_gpu_keys_are_checked_on_local_and_ssh(tmp_path, gpus, min_gpus, message):
    extra = f", min_gpus: {min_gpus}" if min_gpus is not None else ""
    for backend in ("{type: local", "{type: ssh, host: gpu1"):
        path = tmp_path / "tether.yaml"
        path.write_text(f"name: g\ntrainer: {{type: command, command: x}}\nartifacts: [a]\n"
                        f"backends:\n  b: {backend}, gpus: {gpus}{extra}}}\n")
        with pytest.raises(ConfigError) as err:
            load(str(path), files=False)
        assert len(err.value.problems) == 1 and message in err.value.problems[0], err.value.problems


def test_gpu_keys_reach_the_far_side_and_requires_keeps_run_ids(tmp_path):
    from tether.backends.local import Backend
    from tether.config import changed_fields

    path = tmp_path / "tether.yaml"
    path.write_text("name: g\ntrainer: {type: command, command: x, requires: [torch]}\nartifacts: [a]\n"
                    "backends:\n  b: {type: local, gpus: 4, min_gpus: 2, share_gpus: true, num_threads: 3, "
                    "env: {A: 1}}\n")
    job = load(str(path), files=False)
    settings = Backend("b", job.backend_config, str(tmp_path / ".tether")).settings()
    assert {k: settings[k] for k in ("gpus", "min_gpus", "min_free_gpu_mb", "share_gpus")} == \
        {"gpus": 4, "min_gpus": 2, "min_free_gpu_mb": 2000, "share_gpus": True}
    assert settings["env"] == {"A": "1", "OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}
    assert job.trainer.requires() == ("torch",)
    plain = type(job.trainer)(command="x")
    assert plain.requires() == () and "requires" not in changed_fields(plain)  # old run ids stay as they were


# ---------------------------------------------------------------- leases, on real detached launchers

TRAINER = """\
import json, os, sys, time
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "cuda.json"), "w") as f:
    json.dump({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
print("visible", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
deadline = time.time() + 60
while not os.path.exists(os.path.join(os.environ["TETHER_RUN_DIR"], "go")) and time.time() < deadline:
    time.sleep(0.05)
"""


@pytest.fixture
def far(tmp_path):
    """make(run_id) -> run dir under one remote_dir; every run left running is stopped afterwards."""
    made: list[str] = []

    def make(run_id: str) -> str:
        run_dir = tmp_path / "far" / "runs" / run_id
        (run_dir / "code").mkdir(parents=True)
        (run_dir / "code" / "train.py").write_text(TRAINER)
        (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "argv": ["{python}", "train.py"],
                                                      "artifacts": ["cuda.json"], "grace_seconds": 1}))
        made.append(str(run_dir))
        return str(run_dir)
    yield make
    for run_dir in made:
        if launcher.is_alive(run_dir):
            launcher.stop(run_dir, 0.5)


def seen(run_dir: str) -> str:
    path = Path(run_dir, "artifacts", "cuda.json")
    return wait_for(lambda: path.exists() and json.loads(path.read_text()), f"{path}")["CUDA_VISIBLE_DEVICES"]


def lease_owners(remote_dir: Path) -> dict:
    return {int(p.stem): json.loads(p.read_text())["run_id"] for p in (remote_dir / "gpu-leases").glob("*.json")}


def finish(run_dir: str) -> dict:
    Path(run_dir, "go").write_bytes(b"")
    return wait_for(lambda: (lambda s: s if s["final"] and not s["alive"] else None)(launcher.probe(run_dir)),
                    f"{run_dir} to end")


def test_leases_under_concurrency_refusal_release_reclaim_and_share(replay, tmp_path, far):
    replay("query-gpu-memory.txt")
    gpus = captured("query-gpu-memory.txt")
    remote = tmp_path / "far"
    settings = {"remote_dir": str(remote), "gpus": 1, "min_free_gpu_mb": min(g["free"] for g in gpus)}
    runs = [far("r1"), far("r2")]
    answers: dict = {}
    threads = [threading.Thread(target=lambda d=d: answers.setdefault(d, launcher.start(d, settings))) for d in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [answers[d]["outcome"] for d in runs] == ["started", "started"], answers
    visible = {d: seen(d) for d in runs}
    assert sorted(visible.values()) == sorted(str(g["index"]) for g in gpus), visible  # never the same GPU
    assert lease_owners(remote) == {int(visible[d]): os.path.basename(d) for d in runs}
    for d in runs:
        state = launcher.probe(d)["state"]
        assert state["gpus"] == [int(visible[d])]
        event = [json.loads(line) for line in Path(d, "events.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "gpus"]
        assert [e["gpus"][0]["index"] for e in event] == [int(visible[d])], event
        assert event[0]["gpus"][0]["name"] == next(g["name"] for g in gpus if str(g["index"]) == visible[d])

    # a third run finds every GPU leased: refused in one line, left startable
    r3 = far("r3")
    refused = launcher.start(r3, settings)
    assert refused["outcome"] == "error" and refused["error"].startswith("needs 1 GPU(s)"), refused
    for d in runs:
        assert f"{visible[d]}: leased to run {os.path.basename(d)}" in refused["error"]
    assert launcher.probe(r3)["status"] == "pending" and not launcher.probe(r3)["final"]

    # r1 ends: its lease is released, and r3 now starts on r1's GPU
    assert finish(runs[0])["status"] == "completed"
    assert int(visible[runs[0]]) not in lease_owners(remote)
    assert launcher.start(r3, settings)["outcome"] == "started"
    assert seen(r3) == visible[runs[0]]
    assert launcher.probe(r3)["state"].get("launcher_error") is None

    # r2's launcher and trainer are killed outright: its lease is dead, and r4 reclaims the GPU
    dead = launcher.probe(runs[1])["state"]
    for pid in group(dead["pgid"]) + [dead["pid"]]:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not launcher.is_alive(runs[1]), "r2 to be dead")
    assert lease_owners(remote)[int(visible[runs[1]])] == "r2"  # nobody released it
    r4 = far("r4")
    assert launcher.start(r4, settings)["outcome"] == "started"
    assert seen(r4) == visible[runs[1]]
    assert lease_owners(remote) == {int(visible[runs[0]]): "r3", int(visible[runs[1]]): "r4"}

    # share_gpus: the freest GPU, leased or not, and no lease of its own
    r5 = far("r5")
    assert launcher.start(r5, dict(settings, share_gpus=True))["outcome"] == "started"
    assert seen(r5) == str(max(gpus, key=lambda g: g["free"])["index"])
    assert set(lease_owners(remote).values()) == {"r3", "r4"}
    for d in (r3, r4, r5):
        finish(d)
    assert lease_owners(remote) == {} and leases.live(str(remote)) == {}


# ---------------------------------------------------------------- what the user sees: doit run train, status

GPU_SCRIPT = """\
import json, os
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "cuda.json"), "w") as f:
    json.dump({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
print("trained")
"""


def test_doit_refuses_too_few_gpus_then_runs_on_the_freest_and_status_names_it(replay, project):
    replay("query-gpu-memory.txt")
    gpus = captured("query-gpu-memory.txt")
    fit = [g for g in gpus if g["free"] >= 2000]
    (project.root / "gpu.py").write_text(GPU_SCRIPT)
    config = ("name: gpu\ncode: {paths: [gpu.py]}\ntrainer: {type: command, command: '{python} gpu.py'}\n"
              "artifacts: [cuda.json]\nbackends:\n  local: {type: local, gpus: %d%s}\n")
    project.write_config(config % (len(gpus), ""))
    refused = project.doit("run", "train")
    assert refused.returncode != 0
    assert f"needs {len(gpus)} GPU(s) with \u2265 2000 MB free; found {len(fit)}" in refused.stdout + refused.stderr
    assert not any((project.local_run(r) / "launch.json").exists() for r in project.run_ids())

    project.write_config(config % (len(gpus), f", min_gpus: {len(fit)}"))
    train = project.doit("run", "train")
    assert train.returncode == 0, train.stdout + train.stderr
    got = json.loads((project.local_run() / "files" / "artifacts" / "cuda.json").read_text())
    assert got == {"CUDA_VISIBLE_DEVICES": ",".join(str(g["index"]) for g in fit)}
    status = project.doit("status")
    names = ", ".join(g["name"] for g in fit)
    assert f"gpus             {got['CUDA_VISIBLE_DEVICES']} ({names})" in status.stdout, status.stdout
    assert not list((project.root / ".tether" / "remote" / "gpu-leases").glob("*.json"))  # released at the end
