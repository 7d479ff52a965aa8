"""`tether TASK key=value ...`: the same tasks as `doit run TASK key=value ...`, without a dodo.py; `tether agent ...`."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["agent"]:  # `tether agent ...`: the program a mailbox's training machine runs
        from tether.agent.loop import main as agent_main

        return agent_main(args[1:])
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    from tether.pipelines import tasks

    os.makedirs(".tether", exist_ok=True)  # doit opens its dependency file there before any task runs
    tasks.catch_signals()
    namespace = dict(tasks.task_creators(tasks.doit_variables), DOIT_CONFIG=tasks.DOIT_CONFIG)
    try:
        return DoitMain(ModuleTaskLoader(namespace)).run(args)
    except KeyboardInterrupt:
        print(tasks.resume_hint(None), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
