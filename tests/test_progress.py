"""Progress for any script, from its own output: `trainer.progress` on real scripts, real processes.

The scripts are written the way public training scripts are (no `tether` import): one draws a
real tqdm bar on stderr, one prints Hugging Face Trainer-style dict lines under a tqdm bar, one
prints `step 10 loss 2.3` and is read with a regex of the config's own. Each run goes through
`doit run train` (watch's output captured), then `doit status` and `doit report`; one runs over
a real sshd. A script without `progress:` shows its latest log line, never a frozen `0step`, and
a bad `progress:` is refused in one line before anything launches.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest_plugins = ["slurm_fixtures"]  # the session's one SLURM cluster, started only if a test asks for it

from conftest import config_text  # noqa: E402
from helpers import alive, group, poll, stop_leftover_runs  # noqa: E402
from slurm_fixtures import slurm_yaml  # noqa: E402
from tether import config  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.remote import launcher  # noqa: E402
from tether.remote.progress import POLL_S, Parser, Tail  # noqa: E402

TQDM_SCRIPT = """\
import sys, time
from tqdm import tqdm

bar = tqdm(total=60, desc="train", file=sys.stderr, mininterval=0, miniters=1)
for i in range(60):
    time.sleep(0.02)
    bar.set_postfix(loss=round(3.0 / (i + 1), 4), refresh=False)
    bar.update(1)
bar.close()
print("done")
"""

HF_SCRIPT = """\
import sys, time
from tqdm import tqdm

# Hugging Face's Trainer: a bar over the optimizer steps on stderr, a dict of logs every
# logging_steps written above it (tqdm.write, to stdout), a final train_runtime dict.
bar = tqdm(total=45, file=sys.stderr, mininterval=0, miniters=1)
for step in range(1, 46):
    time.sleep(0.02)
    bar.update(1)
    if step % 15 == 0:
        bar.write(str({"loss": round(4.0 - step / 15, 4), "grad_norm": 1.25, "learning_rate": 0.0003,
                       "epoch": round(step / 45, 2)}))
        time.sleep(0.6)  # logs further apart than the events' rate limit: every one is kept
    if step == 30:  # an evaluation bar inside the training one
        for _ in tqdm(range(4), file=sys.stderr, leave=False):
            time.sleep(0.01)
bar.close()
print({"train_runtime": 1.5, "train_samples_per_second": 30.0, "train_loss": 2.5, "epoch": 1.0})
"""

REGEX_SCRIPT = """\
import time

for step in range(1, 51):
    print(f"step {step} loss {5.0 / step:.4f} | lr 0.001", flush=True)
    time.sleep(0.03)
"""

QUIET_SCRIPT = """\
import time

for shard in range(1, 4):
    print(f"loading shard {shard} of 3", flush=True)
    time.sleep(0.6)
print("all shards loaded, finished", flush=True)
"""


def use_script(project, name: str, source: str, progress: str | None = None, total_steps=None,
               backend_name: str = "local", backend: str = "{type: local}") -> None:
    """Put a script into the project and point tether.yaml at it, with `progress:` lines if given."""
    (project.root / "demo" / name).write_text(source)
    text = config_text(command="{python} demo/" + name, code="demo/" + name, artifacts="",
                       backend_name=backend_name, backend=backend)
    extra = "".join(f"  {key}: {value}\n" for key, value in (("progress", progress), ("total_steps", total_steps))
                    if value is not None)
    command = f'  command: "{{python}} demo/{name}"\n'
    assert command in text
    project.write_config(text.replace(command, command + extra))


def train(project, far: Path | None = None) -> subprocess.CompletedProcess:
    done = project.doit("run", "train")
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def progress_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("event") == "step" and e.get("source") == "progress"]


def status(project) -> dict:
    done = project.doit("status", "json=1")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the three shapes


def test_tqdm_bar_gives_steps_loss_status_watch_and_report(project):
    use_script(project, "bar.py", TQDM_SCRIPT, progress="tqdm")
    done = train(project)
    steps = progress_events(project.events())
    assert steps, project.events()
    last = steps[-1]
    assert (last["step"], last["total_steps"], last["loss"]) == (60, 60, 0.05), last
    assert [e["step"] for e in steps] == sorted(e["step"] for e in steps)
    assert len(steps) < 20, f"not rate-limited: {len(steps)} events for 60 bar lines"
    exits = [e for e in project.events() if e["event"] == "exit"]
    assert exits and last["t"] <= exits[-1]["t"]  # written before the exit (and the seal)
    assert "60/60" in done.stderr and "loss=0.05" in done.stderr, done.stderr  # watch's bar
    assert ": 0step" not in done.stderr, done.stderr  # the frozen `train: 0step [01:16, ?step/s]`
    info = status(project)
    assert (info["step"], info["loss"]) == (60, 0.05), info
    text = project.doit("status").stdout
    assert "step" in text and "60" in text and "loss" in text, text
    report = project.doit("report")
    assert report.returncode == 0, report.stdout + report.stderr
    folder = project.local_run() / "report"
    assert json.loads((folder / "facts.json").read_text())["steps"] == 60
    assert (folder / "curves.png").stat().st_size > 0
    assert "train.log" in json.dumps(json.loads((project.local_run() / "PULL_MANIFEST.json").read_text()))


def test_dict_lines_take_the_step_from_the_training_bar(project):
    use_script(project, "hf.py", HF_SCRIPT, progress="dict")
    done = train(project)
    steps = progress_events(project.events())
    assert {e["total_steps"] for e in steps} == {45}, steps  # the evaluation bar (4 steps) is not followed
    assert any(set(e) == {"event", "t", "source", "step", "total_steps"} for e in steps), steps  # the bar alone
    logged = [e for e in steps if "loss" in e]
    assert [(e["step"], e["loss"], e["total_steps"]) for e in logged] == [(15, 3.0, 45), (30, 2.0, 45), (45, 1.0, 45)]
    assert logged[0]["learning_rate"] == 0.0003 and logged[0]["grad_norm"] == 1.25
    final = [e for e in progress_events(project.events()) if "train_runtime" in e]
    assert final and final[-1]["train_loss"] == 2.5 and final[-1]["step"] == 45
    assert status(project)["loss"] == 1.0
    assert "45/45" in done.stderr and "loss=1]" in done.stderr, done.stderr  # the newest loss, shown


def test_custom_regex_with_a_total_from_the_config(project):
    use_script(project, "plain.py", REGEX_SCRIPT, progress=r"'step (?P<step>\d+) loss (?P<loss>[\d.]+)'",
               total_steps=50)
    done = train(project)
    steps = progress_events(project.events())
    assert (steps[-1]["step"], steps[-1]["loss"], steps[-1]["total_steps"]) == (50, 0.1, 50), steps[-1]
    assert all(set(e) == {"event", "t", "source", "step", "loss", "total_steps"} for e in steps), steps
    assert "50/50" in done.stderr, done.stderr
    assert status(project)["step"] == 50


SWEPT_SCRIPT = """\
import sys

lr = float(sys.argv[sys.argv.index("--lr") + 1])
for step in range(1, 11):
    print(f"step {step} loss {lr / step:.3f} acc {1 - lr / 10:.2f}", flush=True)
"""


def test_a_sweep_of_an_unchanged_script_reports_what_progress_read(project):
    (project.root / "demo" / "swept.py").write_text(SWEPT_SCRIPT)
    text = config_text(command="{python} demo/swept.py --lr {lr}", code="demo/swept.py", artifacts="")
    command = '  command: "{python} demo/swept.py --lr {lr}"\n'
    progress = "  progress: 'step (?P<step>\\d+) loss (?P<loss>[\\d.]+) acc (?P<accuracy>[\\d.]+)'\n"
    project.write_config(text.replace(command, command + progress) + "sweep:\n  lr: [1.0, 2.0]\n")
    train(project)
    done = project.doit("report")
    assert done.returncode == 0, done.stdout + done.stderr
    folder = project.root / ".tether" / "reports" / "demo-local"
    results = json.loads((folder / "results.json").read_text())
    assert results["excluded"] == [], results["excluded"]
    found = {p["params"]["lr"]: p for p in results["points"]}
    assert found[1.0]["metrics"] == {"loss": 0.1, "accuracy": 0.9}, found
    assert found[2.0]["metrics"] == {"loss": 0.2, "accuracy": 0.8}, found
    assert {p["metrics_file"] for p in found.values()} == {"events.jsonl"}
    assert "`events.jsonl` (the newest value `progress:` read from the output)" in (folder / "results.md").read_text()


# ---------------------------------------------------------------- without progress:, and bad settings


def test_without_progress_watch_shows_the_latest_log_line_never_0step(project):
    use_script(project, "quiet.py", QUIET_SCRIPT)
    done = train(project)
    assert ": 0step" not in done.stderr and "?step/s" not in done.stderr, done.stderr
    assert "loading shard" in done.stderr, done.stderr  # shown while it ran
    assert "all shards loaded, finished" in done.stderr, done.stderr  # and the last line at the end
    assert not progress_events(project.events())


@pytest.mark.parametrize("progress, words", [
    ("'step (?P<step>\\d+'", "is not a regular expression"),
    ("'loss (?P<loss>[\\d.]+)'", "names no step"),
])
def test_bad_progress_is_refused_in_one_line_before_launch(project, progress, words):
    use_script(project, "plain.py", REGEX_SCRIPT, progress=progress)
    done = project.doit("run", "train")
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()  # the first task (up) stops at the config: one line
    assert len(lines) == 1 and lines[0].startswith("error: up: "), done.stdout + done.stderr
    assert f"tether.yaml:10: error: trainer.progress: " in lines[0] and words in lines[0], lines
    assert project.run_ids() == [] and not (project.root / ".tether" / "remote" / "runs").exists()


# ---------------------------------------------------------------- over ssh


def test_progress_events_over_ssh(project, sshd, tmp_path):
    far = tmp_path / "far"
    try:
        use_script(project, "bar.py", TQDM_SCRIPT, progress="tqdm", backend_name="lab",
                   backend=json.dumps(sshd.backend_config(far)))
        done = train(project)
        run_id = project.run_ids()[-1]
        lines = (far / "runs" / run_id / "events.jsonl").read_text().splitlines()
        steps = progress_events([json.loads(line) for line in lines])
        assert steps and (steps[-1]["step"], steps[-1]["total_steps"]) == (60, 60), steps
        assert "60/60" in done.stderr, done.stderr
        assert status(project)["step"] == 60
    finally:
        stop_leftover_runs(far)


@pytest.mark.parametrize("progress, total_steps, words", [
    (None, 100, "trainer.total_steps needs trainer.progress"),
    (r"'it (?P<step>\d+)'", "n", "trainer.total_steps: 'n' is no group of trainer.progress: add (?P<n>\\d+)"),
    ("tqdm", "n", "trainer.total_steps: the tqdm preset reads the total from the bar"),
    (r"'it (?P<step>\d+)'", 0, "trainer.total_steps must be a positive number"),
])
def test_total_steps_must_fit_progress(project, progress, total_steps, words):
    use_script(project, "plain.py", REGEX_SCRIPT, progress=progress, total_steps=total_steps)
    with pytest.raises(ConfigError) as err:
        config.load(str(project.root / "tether.yaml"))
    assert len(err.value.problems) == 1 and words in err.value.problems[0], err.value.problems


@pytest.mark.parametrize("progress, total_steps", [("tqdm", None), ("dict", 500), ("dict", None),
                                                   (r"'it (?P<step>\d+)/(?P<n>\d+)'", "n")])
def test_presets_and_a_total_group_are_accepted(project, progress, total_steps):
    use_script(project, "plain.py", REGEX_SCRIPT, progress=progress, total_steps=total_steps)
    trainer = config.load(str(project.root / "tether.yaml")).trainer
    assert trainer.launch_spec()["progress"] == progress.strip("'")
    assert trainer.launch_spec()["total_steps"] == total_steps


def test_progress_events_on_slurm(project, cluster, remote):
    (project.root / "demo" / "plain.py").write_text(REGEX_SCRIPT)
    text = slurm_yaml(cluster, remote, "{python} demo/plain.py", code="demo/plain.py", artifacts="")
    command = '  command: "{python} demo/plain.py"\n'
    assert command in text
    project.write_config(text.replace(command, command + "  progress: 'step (?P<step>\\d+) loss (?P<loss>[\\d.]+)'\n"
                                                          "  total_steps: 50\n"))
    train(project)
    run_id = project.run_ids()[-1]
    lines = (remote / "runs" / run_id / "events.jsonl").read_text().splitlines()
    steps = progress_events([json.loads(line) for line in lines])
    assert steps and (steps[-1]["step"], steps[-1]["loss"], steps[-1]["total_steps"]) == (50, 0.1, 50), steps
    assert status(project)["step"] == 50


# ---------------------------------------------------------------- a dead launcher never hurts the trainer


SLOW_SCRIPT = """\
import sys, time

for step in range(1, 10000):
    print(f"step {step} loss 1.0", flush=True)
    if step > 3 and len(sys.argv) > 1 and open(sys.argv[1]).read() == "go":
        print("finished after the launcher died", flush=True)
        break
    time.sleep(0.05)
"""


def test_launcher_killed_the_trainer_goes_on_writing_its_log(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    (run_dir / "code").mkdir(parents=True)
    (run_dir / "code" / "train.py").write_text(SLOW_SCRIPT)
    flag = tmp_path / "flag"
    flag.write_text("")
    spec = {"run_id": "r1", "argv": ["{python}", "train.py", str(flag)], "grace_seconds": 1,
            "progress": r"step (?P<step>\d+) loss (?P<loss>[\d.]+)", "total_steps": None}
    (run_dir / "run.json").write_text(json.dumps(spec))
    started = launcher.start(str(run_dir))
    assert started["outcome"] == "started", started
    pid, pgid = started["state"]["pid"], started["state"]["pgid"]
    try:
        poll(lambda: any(e.get("source") == "progress" for e in _events(run_dir)), 30, "a progress event", 0.05)
        os.kill(pid, signal.SIGKILL)  # the launcher, and with it the thread that reads the log
        poll(lambda: not alive(pid), 10, "the launcher to die", 0.05)
        flag.write_text("go")
        poll(lambda: not group(pgid), 30, "the trainer to finish on its own", 0.05)
        log = (run_dir / "train.log").read_text()
        assert "finished after the launcher died" in log, log[-500:]  # no SIGPIPE, no lost output
    finally:
        for member in group(pgid):
            os.kill(member, signal.SIGKILL)


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


# ---------------------------------------------------------------- the tail itself: rate limit and the last word


def _bar_lines(first: int, last: int) -> bytes:
    return b"".join(b"\r%d/1000 [00:01<00:10, 90.0it/s]" % n for n in range(first, last + 1))


def test_bar_events_are_rate_limited_and_the_newest_is_written_at_the_end(tmp_path):
    log, events = tmp_path / "train.log", tmp_path / "events.jsonl"
    log.write_bytes(b"earlier attempt 999/1000 [\n")  # before the offset: another attempt's output
    tail = Tail(str(log), str(events), Parser("tqdm"), log.stat().st_size).start()
    with open(log, "ab", buffering=0) as out:
        began = time.monotonic()
        step = 0
        while time.monotonic() - began < 2.5:  # a bar redrawn every 5 ms: 500 lines in 2.5 s
            step += 1
            out.write(_bar_lines(step, step))
            time.sleep(0.005)
        written = len(_events(tmp_path))
        poll(lambda: len(_events(tmp_path)) > written, 5, "the next event", 0.005)
        out.write(_bar_lines(step + 1, step + 20))  # the end comes within the rate limit: written all the same
        tail.finish()
    found = [e for e in _events(tmp_path) if e["event"] == "step"]
    assert len(found) <= 2.5 * 2 + 3, f"{len(found)} events in 2.5 s: more than two a second"
    assert found[-1]["step"] == step + 20 and found[-1]["total_steps"] == 1000, found[-1]
    assert all(e["step"] != 999 for e in found), found
    out_of_order = [(a["step"], b["step"]) for a, b in zip(found, found[1:]) if b["step"] < a["step"]]
    assert not out_of_order, out_of_order
    with open(log, "ab") as out:  # finished: nothing more is written (the seal may read events.jsonl)
        out.write(b"\r2000/2000 [")
    time.sleep(POLL_S * 2)
    assert len([e for e in _events(tmp_path) if e["event"] == "step"]) == len(found)
