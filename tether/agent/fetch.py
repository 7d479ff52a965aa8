"""A request's run, from the mailbox into this machine's far side: its files checked, its objects copied, built."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from typing import Any

from tether.backends.farside import FarSide
from tether.backends.local import Backend as LocalBackend
from tether.errors import RunError
from tether.mailbox import Request
from tether.remote.objects import object_path

SHA256 = re.compile(r"[0-9a-f]{64}")


def checked(mail: FarSide, request: Request) -> tuple[bytes, list[dict]]:
    """run.json's bytes and tree.json's files, as the request signed them by SHA-256; RunError if not."""
    run_json = _cat(mail, f"runs/{request.run_id}/run.json")
    tree = _cat(mail, f"runs/{request.run_id}/tree.json")
    for name, data, want in (("run.json", run_json, request.run_json_sha256), ("tree.json", tree, request.tree_sha256)):
        if hashlib.sha256(data).hexdigest() != want:
            raise RunError(f"{name} of {request.run_id} is not the one the request signed (its SHA-256 differs): "
                           f"push and launch again")
    try:
        files = json.loads(tree)["files"]
        if all(SHA256.fullmatch(f["sha256"]) for f in files):
            return run_json, files
    except (ValueError, KeyError, TypeError):
        pass
    raise RunError(f"tree.json of {request.run_id} does not list files by SHA-256: push again")


def _cat(mail: FarSide, path: str) -> bytes:
    try:
        return mail.cat(path)
    except FileNotFoundError:
        raise RunError(f"{path} is not in the mailbox: push and launch again") from None


def copy_objects(mail: FarSide, local: LocalBackend, hashes: list[str]) -> int:
    """Copy the objects the local store lacks from the mailbox, each checked by its SHA-256; how many."""
    objects = os.path.join(local.remote_dir, "objects")
    missing = local.far.have(objects, sorted(set(hashes)))
    for sha in missing:
        target = object_path(objects, sha)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            def write(chunk: bytes) -> None:  # hashed as it lands: a wrong object never gets its name
                digest.update(chunk)
                out.write(chunk)

            try:
                mail.read(f"objects/{sha[:2]}/{sha}", write, stall_s=mail.backend.stall_timeout_s)
            except FileNotFoundError:
                os.unlink(tmp)
                raise RunError(f"object {sha[:12]} is not in the mailbox: push again") from None
        if digest.hexdigest() != sha:
            os.unlink(tmp)
            raise RunError(f"object {sha[:12]} in the mailbox does not hash to its name: push again")
        os.chmod(tmp, 0o444)  # as the store's own receive leaves objects: data/ links them
        os.replace(tmp, target)
    return len(missing)


def build(mail: FarSide, local: LocalBackend, request: Request) -> str:
    """The run's dir here, built as a push builds it (objects first, then code/, data/, work/), with run.json."""
    run_json, files = checked(mail, request)
    copy_objects(mail, local, [f["sha256"] for f in files])
    run_dir = os.path.join(local.remote_dir, "runs", request.run_id)
    done = local.far.push(os.path.join(local.remote_dir, "objects"), run_dir, files, _send_nothing, None)
    if done.bad or done.missing:
        raise RunError(f"{request.run_id}: objects {(done.bad + done.missing)[:3]} could not be stored here: "
                       f"push again")
    local.far.put(f"runs/{request.run_id}/run.json", run_json)
    return run_dir


def _send_nothing(need: list[str], out: Any) -> None:
    """Every object is in the store already: an empty tar."""
    buffer = io.BytesIO()
    tarfile.open(fileobj=buffer, mode="w").close()
    out.write(buffer.getvalue())


def settings(local: LocalBackend, request: Request) -> dict:
    """What `start` gets: the request's settings (its env) under this machine's remote_dir, python and GPUs;
    the job's venv built here first when the request asks for one."""
    env = dict(local.settings().get("env") or {}, **{str(k): str(v) for k, v in
                                                      (request.settings.get("env") or {}).items()})
    found = dict(request.settings, **dict(local.settings(), env=env))
    wanted = {k: request.environment.get(k) for k in ("requirements", "requirements_name", "packages")
              if request.environment.get(k)}
    if wanted.get("requirements") or wanted.get("packages"):
        info = local.far.environment(dict(wanted, remote_dir=local.remote_dir, python=local.base_python,
                                          env=env, build=True, describe=False))
        if info.outcome == "failed":
            raise RunError(f"{request.run_id}: the job's environment could not be built here: {info.error}")
        found["python"] = info.python
    return found
