"""Model files shipped as numbered pieces in PyPI packages, assembled once into a cache folder.

PyPI caps a file at ~100 MB, so a model of a few hundred MB comes as N packages, each holding one
piece. The packages are found with find_spec, never imported, and the assembled file is checked
by size and SHA-256, so a damaged cache or a mismatched piece is never loaded. Standard library
only: the voice service's ASR uses it without pulling in the LM engine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


class MissingPackageError(ValueError):
    """A piece's package is not installed, or its pieces do not assemble to the known file."""


@dataclass(frozen=True)
class PackagedFile:
    filename: str  # the assembled file's path inside the cache folder
    packages: tuple[tuple[str, str], ...]  # (pip requirement, piece's path inside the package folder), in order
    size: int
    sha256: str  # of the assembled file, computed once when the entry was added
    extra: str = ""  # the pyproject extra that lists these packages, if not a base dependency


def numbered_pieces(project: str, version: str, count: int, piece: str = "data/part{i:02d}.bin"
                    ) -> tuple[tuple[str, str], ...]:
    """`project1==version` .. `projectN==version`, the i-th holding `piece` formatted with i."""
    return tuple((f"{project}{i}=={version}", piece.format(i=i)) for i in range(1, count + 1))


def cache_dir() -> Path:
    """Where assembled models live: $DIFFUSION_VOICE_CACHE/models, else ~/.cache/diffusion-voice/models."""
    root = os.environ.get("DIFFUSION_VOICE_CACHE") or Path.home() / ".cache" / "diffusion-voice"
    return Path(root) / "models"


def package_folder(requirement: str) -> Path | None:
    """The installed folder of the package a pip requirement names, or None."""
    spec = importlib.util.find_spec(requirement.split("==")[0].replace("-", "_"))
    folders = list(spec.submodule_search_locations or []) if spec else []
    return Path(folders[0]) if folders else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> dict:
    """What changes when a file is rewritten: the proof that a checked file is still the same one."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _mark(entry: PackagedFile) -> Path:
    """Where the stamp of the entry's last good check is kept (apart: model folders stay as shipped)."""
    return cache_dir() / "checked" / (entry.filename.replace("/", "--") + ".json")


def _checked(target: Path, entry: PackagedFile) -> bool:
    """Is `target` the entry's file? Hashed (~0.7 s per GB) unless its stamp shows it unchanged
    since it last hashed right, so a service start does not read the whole model twice."""
    mark = _mark(entry)
    try:
        if json.loads(mark.read_text()) == {**_stamp(target), "sha256": entry.sha256}:
            return True
    except (OSError, ValueError):
        pass
    if target.stat().st_size != entry.size or _sha256(target) != entry.sha256:
        mark.unlink(missing_ok=True)
        return False
    _write_mark(target, entry)
    return True


def _write_mark(target: Path, entry: PackagedFile) -> None:
    _mark(entry).parent.mkdir(parents=True, exist_ok=True)
    _mark(entry).write_text(json.dumps({**_stamp(target), "sha256": entry.sha256}))


def assemble(name: str, entry: PackagedFile) -> Path:
    """The file of `entry`, assembled from its pieces on first use. A cached file is checked
    against the entry's size and SHA-256 (`_checked`): a truncated or damaged file is replaced,
    and one assembled from mismatched pieces is refused."""
    pieces: list[Path] = []
    missing: list[str] = []
    for requirement, rel in entry.packages:
        folder = package_folder(requirement)
        piece = folder / rel if folder and (folder / rel).is_file() else None
        if piece is None:
            missing.append(requirement)
        else:
            pieces.append(piece)
    if missing:
        extra = f" (or install the project's [{entry.extra}] extra)" if entry.extra else ""
        raise MissingPackageError(f"model {name!r} needs {len(missing)} more package(s): "
                                  f"pip install {' '.join(missing)}{extra}")
    target = cache_dir() / entry.filename
    if target.exists():
        if _checked(target, entry):
            return target
        target.unlink(missing_ok=True)  # damaged or from another version: rebuild it from the packages
    target.parent.mkdir(parents=True, exist_ok=True)
    # a temp file in the same folder, renamed when complete: a crash or a concurrent load never
    # leaves a half-written file under the final name
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        h, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; it is a plain shared model file
        if (size, h.hexdigest()) != (entry.size, entry.sha256):
            raise MissingPackageError(
                f"the pieces of {name!r} assemble to {size} bytes with SHA-256 {h.hexdigest()}, "
                f"expected {entry.size} bytes with {entry.sha256}; reinstall them: "
                f"pip install --force-reinstall {' '.join(r for r, _ in entry.packages)}")
        os.replace(tmp, target)
        _write_mark(target, entry)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
