"""SHA-256 of files and `sha256sum`-format manifests (`<hex>  <name>` a line), so a model folder
can be checked with the same coreutils command that a user would run by hand."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.sha256"
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


class HashMismatch(ValueError):
    """Files whose bytes are not the ones the manifest recorded (or that are gone)."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def format_sha256sum(hashes: dict[str, str]) -> str:
    """The manifest text, names sorted so that equal folders give equal manifests."""
    return "".join(f"{hashes[name]}  {name}\n" for name in sorted(hashes))


def _check_name(name: str, where: str) -> str:
    # A manifest names files inside its own folder; anything else could make verify read (and
    # vouch for) a file elsewhere.
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise ValueError(f"{where}: file name {name!r} must be relative to the manifest's folder")
    return name


def parse_sha256sum(text: str, source: str = MANIFEST) -> dict[str, str]:
    """{name: lowercase hex} of `<64 hex>  <name>` lines (`*name`, binary mode, is accepted too);
    a malformed or repeated line raises ValueError naming source:line."""
    hashes: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{source}:{number}: expected '<64 hex digits>  <file name>', "
                             f"got {line[:80]!r}")
        name = _check_name(match.group(2), f"{source}:{number}")
        if name in hashes:
            raise ValueError(f"{source}:{number}: {name} is listed twice")
        hashes[name] = match.group(1).lower()
    return hashes


def hash_folder(folder: Path, *, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """{relative posix name: hex} of every regular file under folder."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): sha256_file(p)
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() not in exclude}


def write_manifest(folder: Path, name: str = MANIFEST) -> Path:
    """Writes `name` in folder listing every other file of it."""
    path = Path(folder) / name
    path.write_text(format_sha256sum(hash_folder(folder, exclude=(name,))))
    return path


def verify_manifest(manifest: Path) -> dict[str, str]:
    """Checks every file the manifest lists against its recorded hash and returns the hashes.
    Raises HashMismatch naming each file that differs or is missing."""
    manifest = Path(manifest)
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{manifest} is missing: nothing to verify the folder against") from None
    expected = parse_sha256sum(text, str(manifest))
    problems, names = [], []
    for name, want in expected.items():
        path = manifest.parent / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif (got := sha256_file(path)) != want:
            problems.append(f"{name}: sha256 {got} but the manifest says {want}")
        else:
            continue
        names.append(name)
    if problems:
        raise HashMismatch(f"{manifest} does not match the folder ({len(problems)} file(s)): "
                           + "; ".join(problems), names)
    return expected
