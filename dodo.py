"""tether's tasks for `doit`: `doit run train`, `doit status`, `doit run down confirm=yes`, ...

The job comes from config=PATH, else tether.yaml here, else configs/local.yaml; the backend
from backend=NAME, else the config's `backend:`. `doit list` shows every task. Everything
lives in tether.pipelines.tasks; this file only wires it into doit.
"""

import os

from tether.pipelines import tasks

os.makedirs(".tether", exist_ok=True)  # doit opens its dependency file there before any task runs
tasks.catch_signals()

DOIT_CONFIG = tasks.DOIT_CONFIG
globals().update(tasks.task_creators(tasks.doit_variables))
