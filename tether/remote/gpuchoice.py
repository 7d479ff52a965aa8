"""Which GPUs a run gets: the choice (pure), and the launcher's choose-and-lease step under the leases' lock.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). A run asks for `gpus`:
auto (one, if the host has any GPU), a count, pinned indices, or none; and accepts no fewer than
`min_gpus`. A GPU qualifies when it has at least min_free_gpu_mb free, torch has kernels for it
(the preflight's remembered verdict) and no live run leases it (unless share_gpus). Among those,
the ones with the most free memory are chosen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from tether.remote import leases, machine
from tether.remote.fileio import read_json
from tether.remote.rundir import event, run_file, update_state, write_private

REQUEST_FILE = "gpu_request.json"  # in the run dir: the GPU settings of the launch, for the detached launcher
NEED_FIX = "wait for a GPU to free up, lower min_gpus or min_free_gpu_mb, or set share_gpus: true"
FIXES = ((("leased to run",), "wait for those runs to end (or set share_gpus: true)"),
         (("MB free", "free memory unknown"), "wait for memory to free up (or lower min_free_gpu_mb)"),
         (("no kernels",), "install a torch build for these GPUs (pytorch.org/get-started)"))
NO_GPU_FIX = "make the host's GPUs visible to nvidia-smi, or set min_gpus: 0 to train on the CPU"
SETTING_KEYS = ("remote_dir", "gpus", "min_gpus", "min_free_gpu_mb", "share_gpus")


@dataclass(frozen=True)
class Ask:
    """What a run asks for: how many GPUs (or which), the fewest it accepts, memory, sharing."""

    mode: str  # none | auto | count | pinned
    count: int = 0
    pinned: Tuple[int, ...] = ()
    min_gpus: int = 0
    min_free_mb: int = 0
    share: bool = False
    text: str = "none"  # gpus as the config says it

    @classmethod
    def of(cls, settings: Dict[str, Any]) -> "Ask":
        wanted = settings.get("gpus") or "none"  # (a count of 0 is refused by the config)
        free, share = int(settings.get("min_free_gpu_mb") or 0), bool(settings.get("share_gpus"))
        minimum = settings.get("min_gpus")
        if isinstance(wanted, int) and not isinstance(wanted, bool):
            return cls("count", wanted, (), wanted if minimum is None else int(minimum), free, share, str(wanted))
        text = str(wanted)
        if text in ("none", "auto"):
            return cls(text, int(text == "auto"), (), int(minimum or 0), free, share, text)
        pinned = tuple(int(i) for i in text.split(","))
        return cls("pinned", len(pinned), pinned, len(pinned), free, share, text)


@dataclass
class Choice:
    """The GPUs chosen (nvidia-smi's entries), why each other GPU was passed over, or why none can be."""

    chosen: List[Dict[str, Any]] = field(default_factory=list)
    skipped: Dict[int, str] = field(default_factory=dict)
    error: str = ""
    cpu: str = ""  # why the trainer runs on the CPU (the host has no GPU), when it does
    unchecked: str = ""  # pinned indices passed through unchecked (no nvidia-smi)

    @property
    def indices(self) -> List[int]:
        if self.unchecked:
            return [int(i) for i in self.unchecked.split(",")]
        return [int(g["index"]) for g in self.chosen]

    def env(self) -> Dict[str, str]:
        """CUDA_VISIBLE_DEVICES for the trainer ({} on the CPU)."""
        if self.unchecked:
            return {"CUDA_VISIBLE_DEVICES": self.unchecked}
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.indices))} if self.indices else {}


def _reason(g: Dict[str, Any], ask: Ask, no_kernels: Dict[int, str], leased: Dict[int, str]) -> str:
    """Why GPU `g` cannot be given to this run now ('' when it can)."""
    index, free = int(g["index"]), g["memory_free_mb"]
    if index in no_kernels:
        return "no kernels: %s" % no_kernels[index]
    if index in leased and not ask.share:
        return "leased to run %s" % leased[index]
    if free is None and ask.min_free_mb > 0:
        return "free memory unknown"
    if free is not None and free < ask.min_free_mb:
        return "%d MB free" % free
    return ""


def _rank(g: Dict[str, Any]) -> Tuple[bool, int, int, int]:
    """Most free memory first (unknown after every known); then the least busy (unknown counts as busy),
    then the lowest index (a host of idle GPUs fills them in order)."""
    util = g["utilization_pct"]
    return (g["memory_free_mb"] is not None, g["memory_free_mb"] or 0, -(100 if util is None else util),
            -int(g["index"]))


def _reasons_text(skipped: Dict[int, str]) -> str:
    return "; ".join("%d: %s" % (i, why) for i, why in sorted(skipped.items()))


def _fix(why: str, auto: bool = False) -> str:
    """What to do about the reasons in `why` (leases, memory, kernels), and always: accept fewer (for
    gpus: auto, which asks for one, that is the CPU)."""
    fixes = [fix for words, fix in FIXES if any(w in why for w in words)]
    fewer = "or set gpus: none to train on the CPU" if auto else "or lower min_gpus"
    return ", ".join(fixes + [fewer]) if fixes else NEED_FIX


def needs_text(need: int, ask: Ask, found: int, why: str, fix: str = "") -> str:
    """`needs 2 GPU(s) with ≥ 2000 MB free; found 0 (0: 932 MB free; ...)`, with the fix."""
    fix = fix or _fix(why)
    if "free memory unknown" in why:
        fix += " (min_free_gpu_mb: 0 accepts a GPU whose free memory nvidia-smi cannot report)"
    return "needs %d GPU(s) with \u2265 %d MB free; found %d (%s): %s" % (need, ask.min_free_mb, found, why, fix)


def _span(indices: List[int]) -> str:
    ordered = sorted(indices)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return "%d-%d" % (ordered[0], ordered[-1])
    return ", ".join(map(str, ordered))


def choose(ask: Ask, found: Optional[List[Dict[str, Any]]], no_gpu: str = "",
           no_kernels: Optional[Dict[int, str]] = None, leased: Optional[Dict[int, str]] = None) -> Choice:
    """The GPUs for `ask` among `found` (nvidia-smi's list; None: no nvidia-smi; `no_gpu`: why it has none)."""
    if ask.mode == "none":
        return Choice()
    if not found:
        return _without_gpus(ask, found, no_gpu)
    no_kernels, leased = no_kernels or {}, leased or {}
    skipped = {int(g["index"]): _reason(g, ask, no_kernels, leased) for g in found}
    skipped = {i: why for i, why in skipped.items() if why}
    if ask.mode == "pinned":
        return _pinned(ask, found, skipped)
    usable = sorted((g for g in found if int(g["index"]) not in skipped), key=_rank, reverse=True)
    need = max(ask.min_gpus, 1) if ask.mode == "auto" else ask.min_gpus
    chosen = usable[:ask.count]
    if len(chosen) < need:
        why = _reasons_text(skipped)
        return Choice([], skipped, needs_text(need, ask, len(usable), why, _fix(why, ask.mode == "auto")))
    return Choice(chosen, skipped)


def _without_gpus(ask: Ask, found: Optional[List[Dict[str, Any]]], no_gpu: str) -> Choice:
    """A host without a GPU (no nvidia-smi, or it says none): the CPU, unless the run needs GPUs."""
    why = no_gpu or ("nvidia-smi not found" if found is None else "nvidia-smi lists no GPU")
    if ask.mode == "pinned":
        if found is None and not no_gpu:
            return Choice(unchecked=ask.text)  # nothing to check them against: passed on as they are
        return Choice(error="gpus %r names GPUs, but %s: fix the driver, or set gpus: auto to train on the CPU"
                      % (ask.text, why))
    if ask.min_gpus > 0:
        return Choice(error=needs_text(ask.min_gpus, ask, 0, why, NO_GPU_FIX))
    return Choice(cpu=why)


def _pinned(ask: Ask, found: List[Dict[str, Any]], skipped: Dict[int, str]) -> Choice:
    """Pinned GPUs: each must exist and be usable; a pinned GPU is never swapped for another."""
    by_index = {int(g["index"]): g for g in found}
    absent = [i for i in ask.pinned if i not in by_index]
    if absent:
        return Choice(error="gpus \"%s\": this host has GPUs %s (nvidia-smi); pin ones it has, or use a count "
                            "such as gpus: %d" % (ask.text, _span(list(by_index)), len(ask.pinned)))
    bad = {i: skipped[i] for i in ask.pinned if i in skipped}
    if bad:
        return Choice(skipped=bad, error="gpus \"%s\": GPU %s: pin other GPUs, or use a count such as gpus: %d"
                      % (ask.text, _reasons_text(bad), len(ask.pinned)))
    return Choice([by_index[i] for i in ask.pinned], {i: why for i, why in skipped.items() if i in ask.pinned})


def no_kernels_remembered(settings: Dict[str, Any], found: List[Dict[str, Any]]) -> Dict[int, str]:
    """The GPUs the last preflight found no torch kernels for (machine.KERNELS_FILE), with its reason."""
    usable = machine._remembered_usable(settings, found)
    if usable is None:
        return {}
    record = read_json(os.path.join(settings["remote_dir"], machine.KERNELS_FILE)) or {}
    reasons = record.get("reasons") or {}
    return {int(g["index"]): reasons.get(str(g["index"]), "none in the far side's torch (doit check says which)")
            for g in found if int(g["index"]) not in usable}


def looked_up(settings: Dict[str, Any]) -> Tuple[Optional[List[Dict[str, Any]]], str]:
    """nvidia-smi's GPUs (None: no nvidia-smi) and why there are none; ValueError when it fails otherwise."""
    try:
        return machine.gpus(), ""
    except machine.NoGpu as err:
        return [], str(err)
    except RuntimeError as err:
        raise ValueError(machine.NVIDIA_SMI_FIX % err) from None


def leased_to(remote_dir: str, own_run_dir: str = "", reclaim: bool = False) -> Dict[int, str]:
    """GPU index -> the run id of the live lease on it."""
    return {i: str(lease.get("run_id") or lease.get("run_dir")) for i, lease in
            leases.live(remote_dir, own_run_dir, reclaim).items()}


# ---------------------------------------------------------------- the detached launcher's step


def request(run_dir: str, settings: Dict[str, Any]) -> None:
    """Leave the launch's GPU settings in the run dir for its detached launcher (`start` calls it)."""
    write_private(run_file(run_dir, REQUEST_FILE), {k: settings.get(k) for k in SETTING_KEYS})


def claim(run_dir: str, run_id: str) -> Tuple[List[int], str]:
    """Choose and lease the run's GPUs, after its launcher took the run's lock; (leased indices, error).

    The choice lands in launch_env.json (CUDA_VISIBLE_DEVICES), state.json (`gpus`) and one `gpus`
    event. No request (SLURM, whose scheduler allocates GPUs): nothing is done."""
    settings = read_json(run_file(run_dir, REQUEST_FILE))
    if not isinstance(settings, dict) or Ask.of(settings).mode == "none":
        return [], ""
    ask, remote_dir = Ask.of(settings), str(settings["remote_dir"])
    try:
        found, no_gpu = looked_up(settings)
    except ValueError as err:
        return [], str(err)
    if not found or ask.share:  # no GPU to lease, or leases are not this run's business
        choice = choose(ask, found, no_gpu, no_kernels_remembered(settings, found or []))
        return _record(run_dir, choice, []), choice.error
    with leases.locked(remote_dir):
        choice = choose(ask, found, no_gpu, no_kernels_remembered(settings, found),
                        leased_to(remote_dir, run_dir, reclaim=True))
        if not choice.error:
            leases.take(remote_dir, run_dir, run_id, choice.indices)
    return _record(run_dir, choice, [] if choice.error else choice.indices), choice.error


def _record(run_dir: str, choice: Choice, leased: List[int]) -> List[int]:
    """The choice into launch_env.json, state.json and events.jsonl (a refusal only into the event)."""
    shown = [{"index": int(g["index"]), "name": g["name"]} for g in choice.chosen]
    skipped = {str(i): why for i, why in choice.skipped.items()}
    if choice.error:
        event(run_dir, "gpus_refused", error=choice.error, skipped=skipped)
        return []
    env = dict(read_json(run_file(run_dir, "launch_env.json")) or {}, **choice.env())
    write_private(run_file(run_dir, "launch_env.json"), env)
    refusal = (read_json(run_file(run_dir, "state.json"), dict) or {}).get("refused")
    cleared = {"launcher_error": None, "refused": None} if refusal else {}  # an earlier refusal is over
    update_state(run_dir, gpus=choice.indices, gpu_names=[g["name"] for g in choice.chosen],
                 gpus_on_cpu=choice.cpu or None, **cleared)
    event(run_dir, "gpus", gpus=shown, cpu=choice.cpu or None, skipped=skipped, leased=leased,
          visible=choice.env().get("CUDA_VISIBLE_DEVICES"))
    return leased


def refused(run_dir: str, error: str) -> None:
    """A run whose GPUs could not be had: the reason in state.json (for `start` to answer), still startable."""
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    update_state(run_dir, status=state.get("status") or "pending", launcher_error=error, refused=error)


def claim_safely(run_dir: str) -> Tuple[List[int], str]:
    """`claim`, any failure of its own (a damaged request, a lease file in the way) as its refusal."""
    spec = read_json(run_file(run_dir, "run.json"))
    run_id = str(spec.get("run_id")) if isinstance(spec, dict) and spec.get("run_id") else os.path.basename(run_dir)
    try:
        return claim(run_dir, run_id)
    except Exception as err:  # the run is left startable, never half-leased: take() gives back what it took
        return [], "%s: %s" % (type(err).__name__, err)


def give_back(run_dir: str, indices: List[int]) -> None:
    """Release the leases this launcher took (its run has ended, or it is leaving it to another)."""
    settings = read_json(run_file(run_dir, REQUEST_FILE))
    if indices and isinstance(settings, dict):
        leases.release(str(settings["remote_dir"]), run_dir, indices)
