"""The GPU keys of a backend that runs on a host of its own (local, ssh): gpus, min_gpus, memory, sharing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

INDICES = re.compile(r"\d+(,\d+)*")


@dataclass(frozen=True, kw_only=True)
class GpuKeys:
    """gpus: auto (one, if the host has a GPU; else the CPU), a count (4), indices ("0,1") or none;
    min_gpus: the fewest a run accepts (default: as many as gpus asks for; 0 for auto); a GPU needs
    min_free_gpu_mb free; share_gpus: true takes no lease (tether.remote.gpuchoice and leases)."""

    gpus: Union[str, int] = "auto"
    min_gpus: Optional[int] = None
    min_free_gpu_mb: int = 2000
    share_gpus: bool = False

    def gpus_asked(self) -> int:
        """How many GPUs `gpus` asks for (auto: one; none: zero); -1 for a value that is not valid."""
        if isinstance(self.gpus, int):
            return self.gpus if self.gpus >= 1 else -1
        if self.gpus in ("auto", "none"):
            return int(self.gpus == "auto")
        if not INDICES.fullmatch(self.gpus) or len(set(self.gpus.split(","))) != len(self.gpus.split(",")):
            return -1
        return len(self.gpus.split(","))

    def gpu_problems(self) -> list[str]:
        """What is wrong with the GPU keys, each naming its fix."""
        asked = self.gpus_asked()
        if asked < 0:
            return [f'gpus "{self.gpus}": use auto, none, a count such as 2, or indices such as "0,1" '
                    f'(each GPU once)']
        found = [] if self.min_free_gpu_mb >= 0 else [f"min_free_gpu_mb {self.min_free_gpu_mb} must be 0 or more"]
        wanted = self.min_gpus
        if wanted is None:
            return found
        if wanted < 0:
            found.append(f"min_gpus {wanted} must be 0 or more")
        elif self.gpus == "none" and wanted > 0:
            found.append(f"min_gpus {wanted} with gpus: none: ask for GPUs (gpus: {wanted}), or remove min_gpus")
        elif wanted > asked:
            found.append(f"min_gpus {wanted} is more than gpus asks for ({asked}): raise gpus, or lower min_gpus")
        elif isinstance(self.gpus, str) and INDICES.fullmatch(self.gpus) and wanted < asked:
            found.append(f'min_gpus {wanted} with pinned gpus "{self.gpus}": every pinned GPU is needed; to accept '
                         f'fewer, give a count (gpus: {asked}, min_gpus: {wanted})')
        return found

    def gpu_settings(self) -> dict:
        """The GPU part of a launch's or a check's settings, as the far side reads them."""
        return {"gpus": self.gpus, "min_gpus": self.min_gpus, "min_free_gpu_mb": self.min_free_gpu_mb,
                "share_gpus": self.share_gpus}
