"""Sweeps end to end on the local backend, with real processes (no mocks): the `sweep:` section's
checks, one run per point (and only the missing points trained again), parallel points, the
report's table recomputed from the pulled files, unverified points left out, and `repro` of
recorded runs, from a run folder in a fresh copy of the project and from a results.json.

Every expected number is recomputed here from the files on disk, never copied from tether's
own output. Nothing sleeps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
from pathlib import Path

import pytest

from conftest import Project, config_text
from helpers import sha256, stop_leftover_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SWEEP_COMMAND = "{python} demo/train.py --epochs 2 --lr {lr} --seed {seed}"
REPRO_LINE = re.compile(r"^(\S+) -> (\S+): reproduced \((.*)\)$", re.M)


# ---------------------------------------------------------------- helpers


def use_sweep(project: Project, sweep: str, command: str = SWEEP_COMMAND) -> Path:
    """tether.yaml: the demo trainer under `command`, and `sweep` (the section's indented body)."""
    return project.write_config(config_text(command=command) + "sweep:\n" + sweep)


def label(params: dict) -> str:
    """A point's doit sub-task name, written independently of tether.sweep."""
    return ",".join(f"{key}:{value}" for key, value in params.items())


def records(project: Project) -> dict[str, dict]:
    """run.json of every local run folder, by run id."""
    return {run_id: json.loads((project.local_run(run_id) / "run.json").read_text()) for run_id in project.run_ids()}


def originals(project: Project) -> dict[str, str]:
    """Point label -> run id of every training run (not reproductions); one run per point."""
    found: dict[str, str] = {}
    for run_id, record in records(project).items():
        if record.get("repro_of"):
            continue
        key = label(record["params"])
        assert key not in found, f"two runs for point {key}: {found[key]} and {run_id}"
        found[key] = run_id
    return found


def launched(output: str) -> list[str]:
    """The run ids of "<id>: launched (attempt N)" lines (not anchored: parallel doit processes share
    one stdout, so two such lines can run together)."""
    return re.findall(r"([A-Za-z0-9._-]+-\d{8}T\d{6}Z-[0-9a-f]{8}): launched \(attempt \d+\)", output)


def numbers(path: Path) -> dict:
    """The numeric values of a metrics.json (booleans are not numbers)."""
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{statistics.fmean(values):.4g}"
    return f"{statistics.fmean(values):.4g} ± {statistics.stdev(values):.4g}"


def table(markdown: str) -> tuple[list[str], list[list[str]]]:
    """The first Markdown table in `markdown`: its header cells and its rows' cells."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    assert set(lines[start + 1].replace("|", "")) == {"-"}, lines[start + 1]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(split(line))
    return split(lines[start]), rows


def expected_rows(project: Project, run_ids: list[str]) -> dict[str, dict[str, str]]:
    """lr -> {column: cell} from each run's pulled metrics.json and run.json, grouped by lr."""
    grouped: dict[str, dict[str, list]] = {}
    for run_id in run_ids:
        run = project.local_run(run_id)
        params = json.loads((run / "run.json").read_text())["params"]
        group = grouped.setdefault(str(params["lr"]), {})
        for name, value in numbers(run / "files" / "artifacts" / "metrics.json").items():
            group.setdefault(name, []).append(value)
    return {lr: {"n": str(len(next(iter(values.values())))), **{name: cell(v) for name, v in values.items()}}
            for lr, values in grouped.items()}


def flip_a_byte(path: Path, index: int | None = None, keep_mtime: bool = False) -> None:
    """Change one byte of `path` (same size); optionally put its timestamps back as they were."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if index is None else index
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:  # make sure the change shows in the stat too, however coarse the file system's clock is
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 2_000_000_000))


# ---------------------------------------------------------------- the sweep: section


def _line_of(path: Path, prefix: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(prefix))


TORCH_TRAINER = """\
name: digits
backend: local
trainer:
  type: torch-classifier
  layers: [linear:32, relu]
  epochs: 2
  threads: 1
artifacts: [model.*, metrics.json, config.json]
backends:
  local: {type: local}
sweep:
"""


@pytest.mark.parametrize("trainer, sweep, key, words", [
    ("command", "  lr: [0.1, 0.03]\n  batch: [8, 16]\n", "batch", ["{batch}", "trainer.command"]),
    ("command", "  lr: []\n  seed: [0]\n", "lr", ["non-empty list"]),
    ("command", "  lr: [0.1, 0.03, 0.1]\n  seed: [0]\n", "lr", ["twice"]),
    ("command", "  lr: [0.1, [0.2]]\n  seed: [0]\n", "lr", ["numbers, strings or booleans"]),
    ("command", "  lr: [0.1, {a: 1}]\n  seed: [0]\n", "lr", ["numbers, strings or booleans"]),
    ("torch", "  epochs: [1, \"x\"]\n", "epochs", ["integer", "'x'"]),
    ("torch", "  layers: [3]\n", "layers", ["choose from", "lr", "seed", "epochs"]),
    ("torch", "  seed: [0, 1]\n  lr: [0.01, -1]\n", "lr", ["positive"]),
    ("torch", "  lr: [1, 1.0]\n", "lr", ["same trainer settings", "lr:1 and lr:1.0"]),
])
def test_a_bad_sweep_is_refused_with_its_file_and_line(project, trainer, sweep, key, words):
    from tether.config import load
    from tether.errors import ConfigError

    if trainer == "command":
        path = use_sweep(project, sweep)
    else:
        path = project.write_config(TORCH_TRAINER + sweep)
    with pytest.raises(ConfigError) as raised:
        load(str(path))
    problems = raised.value.problems
    mine = [p for p in problems if key in p]
    assert mine, problems
    lines = {_line_of(path, "sweep:"), _line_of(path, f"{key}:")}
    for problem in mine:
        where = re.match(r"(.+?):(\d+): error: ", problem)
        assert where and where.group(1) == str(path) and int(where.group(2)) in lines, problem
    for word in words:
        assert any(word in p for p in mine), (word, problems)


def test_a_good_sweep_loads_and_a_bad_one_stops_validate_and_train(project):
    from tether import sweep as sweep_mod
    from tether.config import load

    path = use_sweep(project, "  lr: [0.1, 0.03]\n  seed: [0, 1, 2]\n")
    job = load(str(path))
    assert job.sweep == {"lr": [0.1, 0.03], "seed": [0, 1, 2]}
    assert [p.label for p in sweep_mod.points(job.sweep)] == [
        label({"lr": lr, "seed": seed}) for lr in (0.1, 0.03) for seed in (0, 1, 2)]
    ok = project.doit("validate")
    assert ok.returncode == 0, ok.stdout + ok.stderr

    # a torch-only setting under the command trainer: {batch_size} is not in the command
    use_sweep(project, "  lr: [0.1, 0.03]\n  batch_size: [8, 16]\n")
    line = _line_of(project.root / "tether.yaml", "sweep:")
    for args in (("validate",), ("run", "train")):
        refused = project.doit(*args)
        output = refused.stdout + refused.stderr
        assert refused.returncode == 1, (args, output)
        assert re.search(rf"tether\.yaml:{line}: error: sweep\.batch_size: .*\{{batch_size\}}", output), output
    assert project.run_ids() == []


# ---------------------------------------------------------------- one run per point


def test_sweep_trains_each_point_once_and_only_the_new_points_after_a_seed_is_added(project):
    use_sweep(project, "  lr: [0.1, 0.03]\n  seed: [0, 1, 2]\n")
    six = [label({"lr": lr, "seed": seed}) for lr in (0.1, 0.03) for seed in (0, 1, 2)]

    listed = project.doit("list", "--all", check=True).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    for phase in ("train", "push", "launch", "watch", "pull", "verify", "down", "tail", "stop"):
        assert phase in names, phase
        assert {n for n in names if n.startswith(phase + ":")} == {f"{phase}:{p}" for p in six}, (phase, listed)
    assert "up" in names and not [n for n in names if n.startswith("up:")], listed

    first = project.doit("run", "train", check=True)
    assert len(launched(first.stdout)) == 6, first.stdout
    runs = originals(project)
    assert sorted(runs) == sorted(six) and len(project.run_ids()) == 6 and len(set(runs.values())) == 6
    for point, run_id in runs.items():
        record = records(project)[run_id]
        lr, seed = record["params"]["lr"], record["params"]["seed"]
        argv = record["argv"]
        assert argv[argv.index("--lr") + 1] == str(lr) and argv[argv.index("--seed") + 1] == str(seed), argv
        run = project.local_run(run_id)
        assert (run / "PULL_VERIFIED.json").is_file(), point
        assert numbers(run / "files" / "artifacts" / "metrics.json")["steps"] == 50  # 2 epochs of 25 batches
    models = {sha256(project.local_run(r) / "files" / "artifacts" / "model.json") for r in runs.values()}
    assert len(models) == 6, "two points trained the same model"

    # nothing left to do
    again = project.doit("run", "train", check=True)
    assert launched(again.stdout) == [] and not re.search(r"^\.  ", again.stdout, re.M), again.stdout
    assert originals(project) == runs

    # a fourth seed: two new points, not started yet
    use_sweep(project, "  lr: [0.1, 0.03]\n  seed: [0, 1, 2, 3]\n")
    eight = [label({"lr": lr, "seed": seed}) for lr in (0.1, 0.03) for seed in (0, 1, 2, 3)]
    before = project.doit("status", check=True).stdout
    rows = [line for line in before.splitlines() if line.startswith("lr:")]
    assert [r.split()[0] for r in rows] == eight, before
    assert sum("not started" in r for r in rows) == 2, before
    assert re.search(r"^8 points: .*6 completed.*; 6 verified here$", before, re.M), before
    assert "2 not started" in before, before

    more = project.doit("run", "train", check=True)
    new = launched(more.stdout)
    assert len(new) == 2 and len(project.run_ids()) == 8, more.stdout
    after = originals(project)
    assert {p: r for p, r in after.items() if p in runs} == runs, "an existing point got a new run"
    assert sorted(new) == sorted(after[p] for p in ("lr:0.1,seed:3", "lr:0.03,seed:3"))

    status = project.doit("status", check=True).stdout
    rows = [line for line in status.splitlines() if line.startswith("lr:")]
    assert [r.split()[0] for r in rows] == eight, status
    for row in rows:
        point, run_id = row.split()[0], row.split()[-1]
        assert run_id == after[point], row
        assert re.search(r"\s{2}completed\s{2}step 50\s{2}loss \S+\s{2}accuracy \S+\s{2}verified\s{2}", row), row
    assert status.rstrip().splitlines()[-1] == "8 points: 8 completed; 8 verified here", status

    as_json = json.loads(project.doit("status", "json=1", check=True).stdout.split("\n", 1)[1])
    assert as_json["summary"] == "8 points: 8 completed; 8 verified here"
    assert [(p["point"], p["run_id"], p["status"], p["verified"], p["step"]) for p in as_json["points"]] == [
        (p, after[p], "completed", True, 50) for p in eight]


def test_training_one_point_trains_only_it_and_leaves_the_others_not_started(project):
    use_sweep(project, "  lr: [0.1, 0.03]\n  seed: [0, 1]\n")
    one = project.doit("run", "train:lr:0.03,seed:1", check=True)
    (run_id,) = launched(one.stdout)
    assert records(project)[run_id]["params"] == {"lr": 0.03, "seed": 1}
    assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()
    status = project.doit("status", check=True).stdout
    rows = {line.split()[0]: line for line in status.splitlines() if line.startswith("lr:")}
    assert sorted(rows) == sorted(["lr:0.1,seed:0", "lr:0.1,seed:1", "lr:0.03,seed:0", "lr:0.03,seed:1"]), status
    assert re.search(r"\s{2}completed\s{2}.*\s{2}verified\s{2}" + run_id + "$", rows.pop("lr:0.03,seed:1")), status
    for point, row in rows.items():
        assert re.fullmatch(re.escape(point) + r"\s+not started", row), f"{point} was never asked for:\n{status}"
    assert status.rstrip().splitlines()[-1] == "4 points: 3 not started, 1 completed; 1 verified here", status
    assert project.run_ids() == [run_id], "a run was recorded for a point that was not asked for"


def test_two_points_at_a_time_with_doit_processes(project):
    use_sweep(project, "  lr: [0.1, 0.03]\n  seed: [0, 1, 2]\n")
    done = project.doit("-n", "2", "-P", "process", "train", check=True)
    assert len(launched(done.stdout)) == 6, done.stdout
    runs = originals(project)
    assert len(runs) == 6 and len(project.run_ids()) == 6
    for run_id in runs.values():
        events = project.events(run_id)
        assert sum(e.get("event") == "launch" for e in events) == 1, run_id  # never launched twice
        far = json.loads((project.remote_run(run_id) / "PULL_MANIFEST.json").read_bytes())
        verified = json.loads((project.local_run(run_id) / "PULL_VERIFIED.json").read_text())
        assert verified["manifest_sha256"] == sha256(project.remote_run(run_id) / "PULL_MANIFEST.json")
        for entry in far["files"]:
            assert sha256(project.local_run(run_id) / "files" / entry["path"]) == entry["sha256"], entry["path"]
    status = json.loads(project.doit("status", "json=1", check=True).stdout.split("\n", 1)[1])
    assert status["summary"] == "6 points: 6 completed; 6 verified here", status
    again = project.doit("run", "-n", "2", "-P", "process", "train", check=True)
    assert launched(again.stdout) == [], again.stdout


# ---------------------------------------------------------------- the report


REPORT_SWEEP = "  lr: [0.3, 3.0]\n  seed: [0, 1, 2]\n"  # the demo's accuracies differ between these seeds


def _report(project: Project) -> tuple[Path, dict, str]:
    done = project.doit("report", check=True)
    folder = project.root / ".tether" / "reports" / "demo-local"
    assert str(folder) in done.stdout, done.stdout
    return folder, json.loads((folder / "results.json").read_text()), (folder / "results.md").read_text()


def _check_table(markdown: str, expected: dict[str, dict[str, str]]) -> None:
    header, rows = table(markdown)
    assert header[:2] == ["lr", "n"], header
    metrics = header[2:]
    assert sorted(metrics) == sorted(next(iter(expected.values())).keys() - {"n"}), header
    assert "seed" not in header
    found = {row[0]: dict(zip(header[1:], row[1:])) for row in rows}
    assert len(found) == len(rows), rows
    assert found == expected, f"table {found}\nrecomputed {expected}"


def test_report_table_is_recomputed_from_the_pulled_metrics(project):
    use_sweep(project, REPORT_SWEEP)
    project.doit("run", "train", check=True)
    runs = originals(project)
    assert len(runs) == 6
    folder, results, markdown = _report(project)

    _check_table(markdown, expected_rows(project, list(runs.values())))
    assert results["excluded"] == []
    assert sorted(p["point"] for p in results["points"]) == sorted(runs)
    for point in results["points"]:
        run = project.local_run(point["run_id"])
        assert runs[point["point"]] == point["run_id"]
        assert point["params"] == json.loads((run / "run.json").read_text())["params"]
        assert point["manifest_sha256"] == sha256(run / "PULL_MANIFEST.json")
        assert point["manifest_sha256"] == sha256(project.remote_run(point["run_id"]) / "PULL_MANIFEST.json")
        assert point["metrics_sha256"] == sha256(run / "files" / "artifacts" / "metrics.json")
        assert point["metrics"] == numbers(run / "files" / "artifacts" / "metrics.json")

    assert (folder / "results.png").read_bytes()[:8] == PNG_SIGNATURE
    provenance = json.loads((folder / "results.provenance.json").read_text())
    assert provenance["results_sha256"] == sha256(folder / "results.json")
    assert provenance["table_sha256"] == sha256(folder / "results.md")
    assert provenance["figure_sha256"] == sha256(folder / "results.png")
    assert sorted((r["run_id"], r["manifest_sha256"]) for r in provenance["runs"]) == sorted(
        (r, sha256(project.local_run(r) / "PULL_MANIFEST.json")) for r in runs.values())


def test_report_leaves_out_unverified_points_and_names_them(project):
    use_sweep(project, REPORT_SWEEP)
    project.doit("run", "train", check=True)
    runs = originals(project)
    unverified, tampered = "lr:0.3,seed:1", "lr:3.0,seed:2"
    (project.local_run(runs[unverified]) / "PULL_VERIFIED.json").unlink()
    flip_a_byte(project.local_run(runs[tampered]) / "files" / "artifacts" / "model.json")

    folder, results, markdown = _report(project)
    kept = [r for p, r in runs.items() if p not in (unverified, tampered)]
    expected = expected_rows(project, kept)
    assert {lr: row["n"] for lr, row in expected.items()} == {"0.3": "2", "3.0": "2"}
    everything = expected_rows(project, list(runs.values()))
    assert expected["0.3"]["accuracy"] != everything["0.3"]["accuracy"], "the left-out point changes nothing"
    _check_table(markdown, expected)

    assert sorted(p["run_id"] for p in results["points"]) == sorted(kept)
    excluded = {e["point"]: e for e in results["excluded"]}
    assert sorted(excluded) == sorted([unverified, tampered]), results["excluded"]
    for point in (unverified, tampered):
        assert excluded[point]["run_id"] == runs[point] and excluded[point]["why"], excluded[point]
    left_out = markdown.split("Left out", 1)
    assert len(left_out) == 2, markdown
    for point in (unverified, tampered):
        assert point in left_out[1] and runs[point] in left_out[1], left_out[1]
        assert point not in left_out[0], "a left-out point appears in the table part"
    provenance = json.loads((folder / "results.provenance.json").read_text())
    assert provenance["excluded"] == results["excluded"]
    assert provenance["results_sha256"] == sha256(folder / "results.json")


# ---------------------------------------------------------------- repro


TORCH_SWEEP = """\
name: digits
backend: local
code:
  paths: [demo/train.py]
trainer:
  type: torch-classifier
  layers: [linear:32, relu]
  epochs: 2
  batch_size: 64
  lr: 0.003
  seed: 0
  threads: 1
artifacts: [model.*, metrics.json, config.json]
sweep:
  seed: [0, 1]
backends:
  local: {type: local}
"""


def model_file(run: Path) -> Path:
    (model,) = [p for p in (run / "files" / "artifacts").iterdir() if p.name.startswith("model.")]
    return model


def test_repro_of_a_torch_run_in_a_fresh_copy_and_its_refusals(project, tmp_path, request):
    pytest.importorskip("torch", reason="the torch extra is part of the test install")
    (project.root / "dodo.py").unlink()  # the `tether` command needs none
    project.write_config(TORCH_SWEEP)
    trained = project.tether("train", timeout=300)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    runs = originals(project)
    assert sorted(runs) == ["seed:0", "seed:1"]
    models = {p: sha256(model_file(project.local_run(r))) for p, r in runs.items()}
    assert models["seed:0"] != models["seed:1"], "the seed did not reach the trainer"
    original = runs["seed:1"]

    # a fresh clone: the project's files, and the recorded run folder
    clone = Project(tmp_path / "clone")
    request.addfinalizer(lambda: stop_leftover_runs(clone.root / ".tether" / "remote"))
    (clone.root / "demo").mkdir(parents=True)
    shutil.copy(project.root / "tether.yaml", clone.root / "tether.yaml")
    shutil.copy(project.root / "demo" / "train.py", clone.root / "demo" / "train.py")
    shutil.copytree(project.local_run(original), clone.root / "recorded" / original)
    path = f"recorded/{original}"

    done = clone.tether("repro", path, "backend=local", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (again,) = clone.run_ids()
    assert (original, again) == REPRO_LINE.search(done.stdout).groups()[:2], done.stdout
    assert "bit-identical" in done.stdout and "reproduced: all 1 run(s), on backend local" in done.stdout
    record = records(clone)[again]
    assert record["repro_of"] == original and record["params"] == {"seed": 1}
    assert sha256(model_file(clone.local_run(again))) == models["seed:1"]

    # the same command again resumes the reproduction: nothing trains twice
    twice = clone.tether("repro", path, "backend=local", timeout=300)
    assert twice.returncode == 0, twice.stdout + twice.stderr
    assert clone.run_ids() == [again] and launched(twice.stdout) == []
    assert REPRO_LINE.search(twice.stdout).groups()[:2] == (original, again)

    # one byte of the code differs from the recorded snapshot: refused, by name and hash
    code = clone.root / "demo" / "train.py"
    good = code.read_bytes()
    flip_a_byte(code, index=10)
    changed = sha256(code)
    refused = clone.tether("repro", path, "backend=local")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "demo/train.py" in refused.stderr and changed in refused.stderr, refused.stderr
    recorded_tree = json.loads((clone.root / "recorded" / original / "files" / "tree.json").read_text())
    (entry,) = [e for e in recorded_tree["files"] if e["path"] == "demo/train.py"]
    assert entry["sha256"] in refused.stderr, refused.stderr
    assert clone.run_ids() == [again] and "reproduced" not in refused.stdout

    # the recorded folder no longer matches its manifest: refused
    code.write_bytes(good)
    flip_a_byte(clone.root / "recorded" / original / "files" / "artifacts" / "metrics.json")
    refused = clone.tether("repro", path, "backend=local")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "manifest" in refused.stderr and "artifacts/metrics.json" in refused.stderr, refused.stderr
    assert clone.run_ids() == [again] and "reproduced" not in refused.stdout


def test_repro_of_every_point_from_results_json_then_from_its_provenance(project):
    use_sweep(project, "  lr: [0.1, 0.03]\n  seed: [0, 1]\n")
    project.doit("run", "train", check=True)
    runs = originals(project)
    project.doit("report", check=True)
    folder = project.root / ".tether" / "reports" / "demo-local"

    done = project.tether("repro", str(folder / "results.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    pairs = {old: new for old, new, _ in REPRO_LINE.findall(done.stdout)}
    assert sorted(pairs) == sorted(runs.values()), done.stdout
    assert "reproduced: all 4 run(s), on backend local" in done.stdout, done.stdout
    known = records(project)
    assert len(known) == 8
    for old, new in pairs.items():
        assert new not in runs.values() and known[new]["repro_of"] == old
        assert known[new]["params"] == known[old]["params"]
        for name in ("model.json", "metrics.json"):
            assert sha256(project.local_run(new) / "files" / "artifacts" / name) == \
                sha256(project.local_run(old) / "files" / "artifacts" / name), (old, new, name)
    # the reproductions do not take the points' place
    status = json.loads(project.doit("status", "json=1", check=True).stdout.split("\n", 1)[1])
    assert {p["point"]: p["run_id"] for p in status["points"]} == runs

    again = project.doit("run", "repro", str(folder / "results.provenance.json"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert {old: new for old, new, _ in REPRO_LINE.findall(again.stdout)} == pairs, again.stdout
    assert launched(again.stdout) == [] and len(project.run_ids()) == 8


def test_repro_rehashes_code_changed_behind_its_timestamp(project):
    """A code file whose bytes changed but whose size and mtime did not (a tool that restores mtimes,
    bit rot) is not the recorded snapshot: repro must hash the file, not trust a stat cache (the
    same standard `down` is held to in test_pipeline.py)."""
    use_sweep(project, "  lr: [0.1]\n  seed: [0]\n")
    project.doit("run", "train", check=True)
    (run_id,) = project.run_ids()
    code = project.root / "demo" / "train.py"
    assert code.read_bytes()[3] == ord("A")  # inside the module docstring: still valid Python
    flip_a_byte(code, index=3, keep_mtime=True)

    refused = project.tether("repro", f".tether/runs/{run_id}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "demo/train.py" in refused.stderr and sha256(code) in refused.stderr, refused.stderr
    assert project.run_ids() == [run_id]


def test_down_of_one_point_then_of_the_whole_sweep(project):
    """`down:POINT` removes only that point's far-side run dir; plain `down` the rest, and says the
    first one is already gone. The verified files stay here."""
    use_sweep(project, "  lr: [0.1]\n  seed: [0, 1]\n")
    project.doit("run", "train", check=True)
    ids = {label(r["params"]): run_id for run_id, r in records(project).items()}
    far = {point: project.remote_run(run_id) for point, run_id in ids.items()}
    assert all(folder.is_dir() for folder in far.values())

    one = project.doit("run", "down:lr:0.1,seed:0", "confirm=yes", check=True)
    assert not far["lr:0.1,seed:0"].exists() and far["lr:0.1,seed:1"].is_dir(), one.stdout

    rest = project.doit("run", "down", "confirm=yes", check=True)
    assert not far["lr:0.1,seed:1"].exists(), rest.stdout
    assert f"{ids['lr:0.1,seed:0']}: already removed" in rest.stdout, rest.stdout
    for run_id in ids.values():
        assert (project.local_run(run_id) / "files" / "artifacts" / "model.json").is_file()


def test_sweep_killed_mid_way_resumes_every_point_once(project):
    """SIGKILL of `doit run train` once two of three points are launched: the same command again
    follows what runs, starts what did not, and launches no point twice."""
    import signal

    use_sweep(project, "  lr: [0.1]\n  seed: [0, 1, 2]\n",
              command="{python} demo/train.py --epochs 150 --lr {lr} --seed {seed}")
    doit = project.start("run", "train")
    try:
        def second_point_training() -> bool:
            launched_here = [r for r in project.run_ids() if (project.local_run(r) / "launch.json").exists()]
            return len(launched_here) >= 2
        project.wait_for(lambda: second_point_training() or doit.poll() is not None, 120, "a second point launched")
        assert doit.poll() is None, "the sweep ended before it could be interrupted: give the points more epochs"
        os.killpg(doit.pid, signal.SIGKILL)
        doit.wait(timeout=30)
    finally:
        if doit.poll() is None:
            os.killpg(doit.pid, signal.SIGKILL)
    project.doit("run", "train", timeout=180, check=True)
    runs = originals(project)
    assert sorted(runs) == ["lr:0.1,seed:0", "lr:0.1,seed:1", "lr:0.1,seed:2"], runs
    for run_id in runs.values():
        events = project.events(run_id)
        assert [e["attempt"] for e in events if e.get("event") == "launch"] == [1], (run_id, events[:3])
        assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()
    stop_leftover_runs(project.root / ".tether" / "remote")


FLAKY = """\
import json, os, sys
seed = int(sys.argv[1])
if seed == 1:
    print("diverged: loss is NaN", flush=True)
    sys.exit(3)
for name in ("model.json", "metrics.json"):
    with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], name), "w") as f:
        json.dump({"accuracy": 0.9 + seed / 100}, f)
"""


def test_a_failed_point_with_continue_leaves_the_others_trained_and_is_left_out(project):
    """`doit run --continue train`: the failing point is reported (exit 1, not doit's 2 for "an
    error"), every other point is trained and verified, status and report name the failed one."""
    (project.root / "demo" / "flaky.py").write_text(FLAKY)
    project.write_config(config_text(command="{python} demo/flaky.py {seed}", code="demo/flaky.py")
                         + "restart: {policy: never}\nsweep:\n  seed: [0, 1, 2]\n")
    done = project.doit("run", "--continue", "train", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: watch:seed:1: run " in done.stderr and "diverged: loss is NaN" in done.stderr, done.stderr
    assert "skipped: train:seed:1, because watch:seed:1 failed" in done.stderr, done.stderr

    rows = {p["point"]: p for p in json.loads(project.doit("status", "json=1", check=True).stdout.split("\n", 1)[1])["points"]}
    assert {k: (v["status"], v["verified"]) for k, v in rows.items()} == {
        "seed:0": ("completed", True), "seed:1": ("failed", False), "seed:2": ("completed", True)}
    project.doit("report", check=True)
    results = json.loads((project.root / ".tether" / "reports" / "demo-local" / "results.json").read_text())
    assert [p["point"] for p in results["points"]] == ["seed:0", "seed:2"]
    assert [(e["point"], e["run_id"]) for e in results["excluded"]] == [("seed:1", rows["seed:1"]["run_id"])]
