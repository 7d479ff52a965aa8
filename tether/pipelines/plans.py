"""What the far side will do next, and what it did on its own, in words: `status` and `watch` say it."""

from __future__ import annotations

import time
from typing import Optional

from tether.remote.protocol import RUNNING, Snapshot


def _clock(t: float) -> str:
    return time.strftime("%H:%M", time.localtime(t))


def _span(seconds: float) -> str:
    """`45 s`, `4 min`, `3 h`: how long, to the unit a person reads."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def restart_words(snap: Snapshot) -> Optional[str]:
    """`will restart from step 1200 in 10 s (attempt 3 of 4)` while the far side waits to restart."""
    plan = snap.state.get("plan")
    if not plan or not snap.alive or plan.get("action") != "restart":
        return None
    step = plan.get("from_step")
    where = f"from step {step}" if step is not None else "from its latest checkpoint"
    return (f"{plan.get('after', snap.status)}; will restart {where} in {_span(plan['at'] - snap.now)} "
            f"(attempt {plan['attempt']} of {plan['of']})")


def previous_words(snap: Snapshot) -> Optional[str]:
    """`stalled 4 min ago; restarted` for a run whose far side restarted it."""
    previous = snap.state.get("previous")
    if not previous or snap.status != RUNNING or not previous.get("at"):
        return None
    reason = f" ({previous['reason']})" if previous.get("reason") else ""
    return f"attempt {previous.get('attempt')} {previous['status']}{reason} {_span(snap.now - previous['at'])} ago; restarted"


def idle_words(snap: Snapshot) -> Optional[str]:
    """The box's idle stop: when it will run (every read restarts the count), or when it ran."""
    idle = snap.idle_stop or {}
    if idle.get("ran_at"):
        return f"idle stop ran at {_clock(idle['ran_at'])} (exit code {idle.get('exit_code')})"
    if idle.get("after_s") and snap.final:
        return f"idle stop in {_span(idle['after_s'])} unless the run is read again (a status or a pull is a read)"
    return None


def notified_words(snap: Snapshot) -> list[str]:
    """`notified completed at 09:14`, or why a notification could not be sent."""
    found = []
    for sent in snap.notified:
        when = _clock(sent.get("at") or snap.now)
        to = f" ({sent['to']})" if sent.get("to") else ""
        found.append(f"notified {sent.get('event')} at {when}{to}" if sent.get("ok") else
                     f"notification {sent.get('event')}{to} failed at {when}: {sent.get('error')}")
    return found


def far_side_words(snap: Snapshot) -> list[str]:
    """Everything above that applies to this snapshot, in the order a reader wants it."""
    found = [restart_words(snap), previous_words(snap), idle_words(snap)]
    return [line for line in found if line] + notified_words(snap)
