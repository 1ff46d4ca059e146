"""`moco embed`: a folder of photos to a file of vectors (and their paths), for your own vector store.

The vectors are the ones the index compares: by default in the export's own space (``Embedder.load(B)``), with
``space=INDEX_DIR`` in that index's space (what its search compares), with ``space="features"`` the raw features
an index stores. Outputs:

    FILE.npy          N x D float32, one row per photo that could be read, in the order of FILE.paths.txt
    FILE.paths.txt    the photos' paths relative to the folder, one per line, as their bytes (not UTF-8 names too:
                      read with open(..., encoding="utf-8", errors="surrogateescape"))
    FILE.parquet      instead of both (with pyarrow): columns path (string) and vector (list of D float32)

Resumable: the photos are listed once and embedded in chunks, each written whole (temporary file, rename) into
``FILE.npy.parts/`` with the list and what the run embeds with (``manifest.json``). An interrupted run (Ctrl+C,
a kill, a crash) continues where it stopped when the same command runs again: finished chunks are read, not
embedded again, unless one of their photos changed since (each chunk records the size and modification time of
its photos, taken before they were read: a chunk with a photo changed or gone is embedded again, so the output is
what a fresh run gives); photos added since join the next run. The output is assembled from the chunks at the end, then
the folder is removed: the run is complete when ``FILE.npy.parts/`` is gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from moco.errors import UserError

__all__ = ["embed_to_file", "PARTS_SUFFIX"]

logger = logging.getLogger(__name__)

PARTS_SUFFIX = ".parts"  # FILE.npy.parts/: the chunks of an unfinished run
_MANIFEST = "manifest.json"
_LIST = "paths.txt"
_FORMAT = "moco-embed-parts"


def _names_bytes(names: list[str]) -> bytes:
    """The paths as lines of their own bytes (a name that is not UTF-8 keeps its bytes)."""
    return b"".join(os.fsencode(n) + b"\n" for n in names)


def _read_names(path: Path) -> list[str]:
    return [os.fsdecode(line) for line in path.read_bytes().splitlines()]


def _check_out(out: Path) -> str:
    """The output kind ("npy" or "parquet") of ``out``, or a UserError with the fix."""
    kind = {".npy": "npy", ".parquet": "parquet"}.get(out.suffix.lower())
    if kind is None:
        raise UserError(f"-o {out}: name the output FILE.npy (vectors, with FILE.paths.txt beside it) or "
                        "FILE.parquet (paths and vectors in one table, needs pyarrow)")
    if out.is_dir():
        raise UserError(f"-o {out} is a folder: give a file name, e.g. -o {out / ('vectors' + out.suffix)}")
    if out.parent.exists() and not out.parent.is_dir():
        raise UserError(f"-o {out}: {out.parent} is not a folder")
    if kind == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise UserError(f"-o {out}: writing parquet needs pyarrow: pip install pyarrow, or write "
                            f"-o {out.with_suffix('.npy')} (vectors and a paths file)") from None
    return kind


def _check_names(names: list[str], root: Path, kind: str) -> None:
    """Refuse, before any work, photos whose paths the output cannot hold."""
    if not names:
        raise UserError(f"no photos in {root} (jpg png webp bmp tiff gif, searched recursively): check the folder")
    for name in names:
        if "\n" in name or "\r" in name:
            raise UserError(f"{root / name!r}: a line break in its name cannot be written one path per line: "
                            "rename the file")
        if kind == "parquet":
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise UserError(f"{root / name!r}: its name is not UTF-8, which a parquet string cannot hold: "
                                "rename it, or write FILE.npy (its paths file keeps any name's bytes)") from None


def _load_embedder(backbone: str, space: str | None, features: bool, device: str) -> Any:
    from moco.embed import Embedder

    if space is not None and not Path(space).is_dir():
        raise UserError(f"--space {space}: no such index folder: pass a folder made by `moco index build`")
    return Embedder.load(backbone, device=device, space="features" if features else space)


def _manifest(root: Path, emb: Any, names: list[str], chunk_size: int, exclude: tuple[str, ...]) -> dict[str, Any]:
    return {"format": _FORMAT, "version": 1, "folder": str(root.resolve()),
            "backbone_sha256": emb.sha256, "space": emb.space_id, "dim": emb.dim, "count": len(names),
            "chunk_size": chunk_size, "paths_sha256": hashlib.sha256(_names_bytes(names)).hexdigest(),
            "exclude": list(exclude)}


def _start_or_resume(parts: Path, root: Path, emb: Any, chunk_size: int, kind: str,
                     exclude: tuple[str, ...]) -> tuple[list[str], int, bool, list[str]]:
    """The photo list and chunk size of this run: an unfinished run's (checked to embed the same way), else a new
    listing saved into ``parts``. Returns (names, chunk_size, resumed, the notes of formats not read)."""
    from moco.data.photos import scan_photos
    from moco.files import atomic_write

    manifest_path = parts / _MANIFEST
    if manifest_path.is_file():
        try:
            saved = json.loads(manifest_path.read_text())
            names = _read_names(parts / _LIST)
        except (OSError, ValueError) as e:
            raise UserError(f"{parts} holds an unfinished run that cannot be read ({e}): delete {parts} to start "
                            "over") from None
        now = _manifest(root, emb, names, int(saved.get("chunk_size", 0)), exclude)
        differ = [k for k in ("format", "version", "folder", "backbone_sha256", "space", "dim", "count",
                              "paths_sha256", "exclude") if saved.get(k, []) != now[k]]
        if differ:
            what = {"folder": "another photo folder", "backbone_sha256": "another backbone",
                    "space": "another space (--space/--features)", "dim": "another width",
                    "exclude": "other --exclude patterns"}
            why = ", ".join(sorted({what.get(k, "a damaged list") for k in differ}))
            raise UserError(f"{parts} holds an unfinished run with {why}: run the same command as that run to "
                            f"finish it, or delete {parts} to start over")
        if chunk_size != saved["chunk_size"]:
            logger.info("resuming with the unfinished run's --chunk-size %d", saved["chunk_size"])
        return names, int(saved["chunk_size"]), True, []
    scan = scan_photos(root, exclude)
    names = scan.files
    for note in scan.notes():
        logger.warning("%s: %s", root, note)
    _check_names(names, root, kind)
    atomic_write(parts / _LIST, lambda f: f.write(_names_bytes(names)))
    manifest = json.dumps(_manifest(root, emb, names, chunk_size, exclude), indent=1).encode()
    atomic_write(manifest_path, lambda f: f.write(manifest))  # last: a listing without it is listed again
    return names, chunk_size, False, scan.notes()


def _chunk_path(parts: Path, i: int) -> Path:
    return parts / f"chunk-{i:07d}.npz"


def _stats(root: Path, names: list[str]) -> np.ndarray:
    """len(names) x 2 int64: each photo's size and modification time (ns); -1, -1 for one that cannot be read."""
    out = np.full((len(names), 2), -1, np.int64)
    for i, name in enumerate(names):
        try:
            st = os.stat(root / name)
        except OSError:
            continue
        out[i] = (st.st_size, st.st_mtime_ns)
    return out


def _embed_chunk(emb: Any, root: Path, names: list[str], start: int, batch_size: int, workers: int | None,
                 bar: Any) -> dict[str, np.ndarray]:
    """Embed ``names`` (positions ``start``...): vectors of the readable ones, their positions, the others', and
    every photo's size and modification time as they were before reading (``stats``)."""
    position = {n: start + i for i, n in enumerate(names)}
    stats = _stats(root, names)  # before reading: a photo changed while it is read is seen as changed next time
    vectors, ok, failed, reasons = [], [], [], []
    for paths, vecs, failures in emb.embed_folder(root, batch_size=batch_size, workers=workers, progress=False,
                                                  files=names):
        vectors.append(vecs)
        ok += [position[p] for p in paths]
        failed += [position[p] for p, _ in failures]
        reasons += [why for _, why in failures]
        bar.update(len(paths) + len(failures))
    return {"vectors": np.concatenate(vectors).astype(np.float32, copy=False) if vectors else
            np.zeros((0, emb.dim), np.float32), "ok": np.asarray(ok, np.int64), "failed": np.asarray(failed, np.int64),
            "reasons": np.asarray(reasons, dtype=str), "stats": stats}


def _chunk_is_current(path: Path, root: Path, names: list[str]) -> bool:
    """Whether the finished chunk ``path`` still holds the vectors of ``names``: it can be read and every photo has
    the size and modification time it had when the chunk was embedded (a chunk of an older version records none)."""
    if not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as z:
            stats = z["stats"] if "stats" in z.files else None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        logger.warning("embedding %s again: it cannot be read (%s)", path.name, e)
        return False
    if stats is None or stats.shape != (len(names), 2):
        return False
    changed = np.flatnonzero(np.any(stats != _stats(root, names), axis=1))
    if len(changed):
        logger.info("embedding %s again: %d of its photos changed since it was embedded (e.g. %s)", path.name,
                    len(changed), names[changed[0]])
        return False
    return True


def _read_chunk(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _write_npy(out: Path, chunks: list[Path], names: list[str], rows: int, dim: int) -> Path:
    """FILE.npy (streamed chunk by chunk: memory holds one chunk) and FILE.paths.txt beside it."""
    from moco.files import atomic_write

    def vectors(f: Any) -> None:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
        for c in chunks:
            f.write(np.ascontiguousarray(_read_chunk(c)["vectors"], "<f4").tobytes())

    def paths(f: Any) -> None:
        for c in chunks:
            f.write(_names_bytes([names[i] for i in _read_chunk(c)["ok"]]))

    listing = out.with_name(out.name[: -len(out.suffix)] + ".paths.txt")
    atomic_write(listing, paths)
    atomic_write(out, vectors)
    return listing


def _write_parquet(out: Path, chunks: list[Path], names: list[str], dim: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("path", pa.string()), ("vector", pa.list_(pa.float32(), dim))])
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with pq.ParquetWriter(str(tmp), schema) as writer:  # one row group per chunk: memory holds one chunk
            for c in chunks:
                chunk = _read_chunk(c)
                flat = pa.array(np.ascontiguousarray(chunk["vectors"], np.float32).ravel())
                writer.write_table(pa.table({"path": [names[i] for i in chunk["ok"]],
                                             "vector": pa.FixedSizeListArray.from_arrays(flat, dim)}, schema=schema))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def embed_to_file(
    root: str | os.PathLike[str], backbone: str, out: str | os.PathLike[str], *, space: str | None = None,
    features: bool = False, chunk_size: int = 1024, batch_size: int = 64, workers: int | None = None,
    device: str = "auto", progress: bool = True, exclude: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """Embed the photos under ``root`` (less the ``exclude`` patterns, never read) into ``out`` (FILE.npy +
    FILE.paths.txt, or FILE.parquet), resuming an unfinished run of the same command. Returns a summary (plain
    types; ``not_read``: a line per format whose package is missing, with the fix)."""
    from moco.excludes import check_patterns
    from moco.files import lock_dir

    exclude = check_patterns(exclude, root=root)

    out, root = Path(out).expanduser(), Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"{root}: {'not a folder' if root.exists() else 'no such folder'}: pass the folder of photos")
    if space is not None and features:
        raise UserError("--space INDEX_DIR and --features ask for two different outputs: pass one of them")
    if chunk_size < 1 or batch_size < 1:
        raise UserError(f"--chunk-size {chunk_size} and --batch-size {batch_size} must be at least 1, "
                        "e.g. --chunk-size 1024 --batch-size 64")
    kind = _check_out(out)
    emb = _load_embedder(backbone, space, features, device)
    parts = out.with_name(out.name + PARTS_SUFFIX)
    created = not parts.exists()
    try:
        parts.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise UserError(f"-o {out}: cannot make the folder {e.filename} (a file is in the way): choose another "
                        "output path") from None
    try:
        with lock_dir(parts, "-o"):  # one run per output: a second one is told who holds it
            summary = _embed_parts(parts, root, emb, out, kind, chunk_size, batch_size, workers, progress, exclude)
    except BaseException as e:
        if created and not (parts / _MANIFEST).exists():  # nothing to resume: leave no folder behind
            shutil.rmtree(parts, ignore_errors=True)
        elif isinstance(e, KeyboardInterrupt):
            logger.info("the finished chunks are kept in %s: run the same command to continue", parts)
        raise
    space_text = ("the backbone's features" if emb.space is None else
                  f"the space of {space}" if space is not None else "the export's space")
    return {**summary, "space": space_text}


def _embed_parts(parts: Path, root: Path, emb: Any, out: Path, kind: str, chunk_size: int, batch_size: int,
                 workers: int | None, progress: bool, exclude: tuple[str, ...]) -> dict[str, Any]:
    """Embed the chunks not done yet, assemble the output from all of them, remove ``parts``."""
    from tqdm.auto import tqdm

    from moco.files import atomic_write

    names, chunk_size, resumed, not_read = _start_or_resume(parts, root, emb, chunk_size, kind, exclude)
    for stale in parts.glob(".*.tmp"):  # a chunk being written when the run was killed
        stale.unlink(missing_ok=True)
    n_chunks = -(-len(names) // chunk_size)
    chunks = [_chunk_path(parts, i) for i in range(n_chunks)]
    done = [_chunk_is_current(c, root, names[i * chunk_size : (i + 1) * chunk_size]) for i, c in enumerate(chunks)]
    if resumed:
        logger.info("resuming %s: %d of %d chunks were embedded before", parts, sum(done), n_chunks)
    finished = sum(min(chunk_size, len(names) - i * chunk_size) for i in range(n_chunks) if done[i])
    with tqdm(total=len(names), initial=finished, disable=not progress, unit="img", desc="embedding") as bar:
        for i, path in enumerate(chunks):
            if done[i]:
                continue
            arrays = _embed_chunk(emb, root, names[i * chunk_size : (i + 1) * chunk_size], i * chunk_size,
                                  batch_size, workers, bar)
            atomic_write(path, lambda f, a=arrays: np.savez(f, **a))
    rows, failed, reasons = 0, 0, []
    for c in chunks:
        chunk = _read_chunk(c)
        rows += len(chunk["ok"])
        failed += len(chunk["failed"])
        reasons += [f"{names[i]}: {why}" for i, why in zip(chunk["failed"], chunk["reasons"])][: 3 - len(reasons)]
    if not rows:
        raise UserError(f"none of the {len(names)} photos in {root} could be read (e.g. {reasons[0]}); "
                        f"delete {parts} after fixing them")
    listing = None
    if kind == "npy":
        listing = _write_npy(out, chunks, names, rows, emb.dim)
    else:
        _write_parquet(out, chunks, names, emb.dim)
    shutil.rmtree(parts)
    return {"out": str(out), "paths": str(listing) if listing else None, "rows": rows, "dim": emb.dim,
            "skipped": failed, "skipped_examples": reasons, "resumed_chunks": sum(done), "chunks": n_chunks,
            "not_read": not_read}
