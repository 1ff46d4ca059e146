"""Embedder: images -> L2-normalized float32 vectors with an exported MoCo backbone.

    >>> import numpy as np
    >>> from moco import Embedder
    >>> emb = Embedder.load(backbone_path, device="cpu")   # a file made by `moco export`
    >>> vectors = emb.embed([np.zeros((40, 60, 3), np.uint8), np.full((64, 64, 3), 200, np.uint8)])
    >>> vectors.shape == (2, emb.dim), vectors.dtype
    (True, dtype('float32'))
    >>> bool(np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3))
    True

Preprocessing comes from the backbone's metadata (short side resized to ``resize``, center crop of
``image_size``, mean/std): the same eval view the kNN monitor uses during training.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from moco.config import is_vit
from moco.data.augment import center_view
from moco.data.photos import ImageDecodeError, load_square_u8, read_image_bytes, scan_images, square_u8
from moco.errors import UserError
from moco.export.meta import BackboneMeta
from moco.runtime import autocast_for, resolve_device, resolve_precision
from moco.whiten import Whitening, embedding_features, whiten_features

__all__ = ["Embedder", "center"]

logger = logging.getLogger(__name__)

ImageLike = Any  # PIL.Image.Image | str | Path | np.ndarray | torch.Tensor


def center(vectors: np.ndarray, mean: np.ndarray | None) -> np.ndarray:
    """``normalize(vectors - mean)`` row by row (N x D float32); ``vectors`` as they are when ``mean`` is None.

    Pooled ReLU features sit in a narrow cone (any two photos score ~0.9); centred on the collection's
    mean embedding, an unrelated photo scores near 0. A row equal to the mean stays all zeros.
    """
    v = np.ascontiguousarray(np.atleast_2d(vectors), np.float32)  # N x D
    if mean is None:
        return v
    c = v - np.asarray(mean, np.float32)[None, :]  # N x D
    norms = np.linalg.norm(c, axis=1, keepdims=True)  # N x 1
    return (c / np.maximum(norms, 1e-12)).astype(np.float32)


def _cached_digest(path: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime, inode): loading one file twice hashes it once."""
    from moco.files import sha256_file

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def _export_cache(checkpoint: Path, digest: str) -> Path:
    """Where the export of a checkpoint or official model is kept (``$MOCO_HOME/exports/<sha256>.safetensors``),
    so ``Embedder.load(NAME)`` exports it once, not on every call."""
    from moco.weights.pretrained import moco_home

    folder = moco_home() / "exports"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{digest}.safetensors"


def _read_space(where: Path, digest: str, backbone: Path) -> Whitening:
    """The space in ``where`` (an index directory's ``space.safetensors``, or such a file), checked to belong to
    the backbone whose file has sha256 ``digest``."""
    from moco.whiten import SPACE_FILE, load_space

    path = where / SPACE_FILE if where.is_dir() else where
    if not path.is_file():
        raise UserError(f"space={where}: no {SPACE_FILE} there: pass an index directory made by `moco index build` "
                        "(`moco index update DIR` writes it for an older index) or a space file")
    try:
        space, meta = load_space(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    if meta.get("backbone_sha256") != digest:
        raise UserError(f"{path} is the space of backbone sha256 {str(meta.get('backbone_sha256'))[:12]}..., not of "
                        f"{backbone} ({digest[:12]}...): load the backbone that index was built with")
    return space


def _square_on_device(img: torch.Tensor, size: int) -> torch.Tensor:
    """3 x H x W uint8 -> size x size x 3 uint8: short side resized (antialiased bicubic), center crop."""
    _, h, w = img.shape
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    x = F.interpolate(img[None].float(), size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
    top, left = (nh - size) // 2, (nw - size) // 2
    x = x[0, :, top : top + size, left : left + size].round_().clamp_(0, 255).to(torch.uint8)  # 3 x s x s
    return x.permute(1, 2, 0).contiguous()  # s x s x 3


class Embedder:
    """Feature extractor around an exported backbone.

    Attributes:
        dim: the width D of the vectors it makes.
        config: the backbone's metadata (:class:`moco.export.meta.BackboneMeta`: arch, image_size, resize, mean, std,
            source sha256, ...).
        sha256: sha256 of the backbone file (what an index records to refuse a different backbone).
        space: the embedding space every vector goes through (:class:`moco.whiten.Whitening`: centred, whitened),
            or None: the features as they are, L2-normalized. By default the space the export carries (a run
            trained with ``--whiten``: fitted on its training photos); ``Embedder.load(B, space=INDEX_DIR)``: the
            space of an index (fitted on the collection it searches), so its vectors equal the index's.
        mirror, stages: the features: each image averaged with its mirror image, the pooled earlier stages of a
            ResNet beside its output (``dim`` counts them); both come from the export.
        pixel_mean, pixel_std: the preprocessing's per-channel normalization.
    """

    def __init__(self, backbone: nn.Module, config: BackboneMeta, device: str | torch.device = "auto",
                 precision: str = "auto", sha256: str = "", whitening: Whitening | None = None,
                 features: Whitening | None = None) -> None:
        self.device = resolve_device(str(device))
        self.space = whitening  # applied to every embedding (moco.whiten); None: the backbone's features
        self.export_space = features if features is not None else whitening  # the one the file carries
        recipe = whitening if whitening is not None else features  # which features: mirror image, stages
        self.mirror = bool(recipe.mirror) if recipe is not None else False
        self.stages: tuple[tuple[str, int], ...] = tuple(recipe.stages) if recipe is not None else ()
        self.precision = resolve_precision(precision, self.device)
        self.config = config
        self.sha256 = sha256
        self.dim = config.embed_dim + sum(c for _, c in self.stages)  # with the pooled stages
        self.image_size = config.image_size
        self.resize = config.resize
        self.pixel_mean, self.pixel_std = config.mean, config.std
        # CNNs run channels_last on every device: 1.5-1.6x faster on this CPU (oneDNN; bench/layout.py), as on GPUs
        self.channels_last = not is_vit(config.arch)
        self.backbone = backbone.to(self.device).eval()
        if self.channels_last:
            self.backbone = self.backbone.to(memory_format=torch.channels_last)
        self._white = None if whitening is None else (
            torch.from_numpy(whitening.mean).to(self.device),
            None if whitening.matrix is None else torch.from_numpy(whitening.matrix).to(self.device))

    @property
    def space_id(self) -> str:
        """Names what this embedder outputs: the backbone file, the features and the space (two embedders with the
        same id give the same vectors)."""
        feats = f"mirror={int(self.mirror)},stages={'+'.join(n for n, _ in self.stages) or '-'}"
        return f"{self.sha256[:12]}/{feats}/{self.space.digest if self.space is not None else 'features'}"

    def describe(self) -> dict[str, Any]:
        """What the vectors are (plain types): width, whitened, centred, L2-normalized, features, fitted on."""
        if self.space is not None:
            return {**self.space.describe(), "backbone_sha256": self.sha256}
        return {"width": self.dim, "whitened": False, "centred": False, "normalized": True, "mirror": self.mirror,
                "stages": [[n, int(c)] for n, c in self.stages], "fitted_on": None, "count": 0, "shrinkage": None,
                "digest": None, "backbone_sha256": self.sha256}

    @classmethod
    def load(cls, path: str | Path, device: str = "auto", precision: str = "auto", whiten: bool = True,
             space: str | Path | None = None) -> Embedder:
        """From a ``.safetensors`` backbone made by ``moco export``, or from any checkpoint or official NAME.

        ``space``: None: the space the file carries (a run trained with ``--whiten``, as the cpu preset: its
        whitening with its mirror-image average and pooled stages), else the features as they are; an index
        directory: the space of that index (fitted on the photos it searches: the same vectors as its search);
        ``"features"``: the file's features (mirror image, stages) L2-normalized, no space (what an index stores).
        ``whiten`` False: the backbone's features as they are, one view per image, no space.
        """
        from moco.export.exporter import export_backbone
        from moco.export.reader import build_exported, exported_whitening, load_exported
        from moco.weights.pretrained import resolve

        path = resolve(path)
        if path.is_dir():
            raise UserError(f"backbone {path} is a folder: pass the file (made by `moco export`, e.g. "
                            f"{path / 'model.safetensors'} of a --format timm export), a checkpoint or a NAME")
        if not path.is_file():
            raise UserError(f"backbone {path}: file not found: pass a backbone made by `moco export` (`moco export "
                            "RUN/checkpoint.pt -o B.safetensors`), a checkpoint or an official NAME "
                            "(`moco pretrained`)")
        digest = _cached_digest(path)
        if path.suffix != ".safetensors":
            try:
                out = _export_cache(path, digest)
                if not out.is_file():
                    export_backbone(path, out)
                state, meta = load_exported(out)
            except OSError as e:  # no writable cache: export into a temporary folder, as before
                logger.debug("export cache unavailable (%s): exporting %s into a temporary folder", e, path)
                import tempfile

                with tempfile.TemporaryDirectory() as tmp:
                    export_backbone(path, Path(tmp) / "backbone.safetensors")
                    state, meta = load_exported(Path(tmp) / "backbone.safetensors")
        else:
            state, meta = load_exported(path)
        own = exported_whitening(state, meta, path) if whiten else None
        emb_space: Whitening | None = own
        if space is not None and str(space) == "features":
            emb_space = None
        elif space is not None:
            emb_space = _read_space(Path(space), digest, path)
        return cls(build_exported(state, meta, path), meta, device, precision, digest, emb_space, features=own)

    # --------------------------------------------------------------------------------- inputs
    def _to_square(self, item: ImageLike) -> np.ndarray:
        """One input as a ``resize x resize x 3`` uint8 array (short side resized, center crop)."""
        if isinstance(item, (str, Path)):
            return load_square_u8(item, self.resize)
        if isinstance(item, Image.Image):
            return square_u8(item.convert("RGB"), self.resize)
        if isinstance(item, torch.Tensor):
            item = item.detach().cpu().numpy()
        if isinstance(item, np.ndarray):
            if item.dtype != np.uint8:
                raise UserError(f"image arrays must be uint8 (0-255), got {item.dtype}: convert with "
                                "(x * 255).clip(0, 255).astype(np.uint8) for floats in [0, 1]")
            if item.ndim == 2:
                item = np.repeat(item[:, :, None], 3, axis=2)
            elif item.ndim == 3 and item.shape[0] in (1, 3) and item.shape[2] not in (1, 3):
                item = item.transpose(1, 2, 0)  # CHW -> HWC
            if item.ndim != 3 or item.shape[2] not in (1, 3):
                raise UserError(f"image arrays must be HxWx3, 3xHxW or HxW, got shape {item.shape}")
            if item.shape[2] == 1:
                item = np.repeat(item, 3, axis=2)
            return square_u8(Image.fromarray(np.ascontiguousarray(item)), self.resize)
        raise UserError(
            f"cannot embed a {type(item).__name__}: pass PIL images, file paths, or uint8 numpy arrays / tensors"
        )

    # ------------------------------------------------------------------------------- embedding
    @torch.inference_mode()
    def embed_squares(self, squares: np.ndarray | torch.Tensor, normalize: bool = True) -> np.ndarray:
        """Embed preprocessed uint8 squares (N x resize x resize x 3): N x D float32, L2-normalized unless not
        ``normalize``."""
        x = torch.as_tensor(squares).to(self.device, non_blocking=True)  # N x R x R x 3 uint8
        return self.embed_views(center_view(x, self.image_size, self.pixel_mean, self.pixel_std), normalize)

    @torch.inference_mode()
    def embed_views(self, x: torch.Tensor, normalize: bool = True) -> np.ndarray:
        """Embed already normalized views (N x 3 x s x s float, e.g. augmented): N x D float32, L2-normalized
        unless not ``normalize`` (then the features: the backbone's pooled output, averaged with the mirror image's and
        with pooled stages where the export says so; with a space ``(f/|f| - mean) @ W``)."""
        x = x.to(self.device, non_blocking=True)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast_for(self.device, self.precision):
            f = embedding_features(self.backbone, x, self.mirror, tuple(n for n, _ in self.stages))  # N x D
        if f.shape[1] != self.dim:
            raise UserError(f"the backbone's features are {f.shape[1]}-d, its space's {self.dim}-d: export it again")
        if self._white is not None:
            f = whiten_features(F.normalize(f, dim=1), *self._white)  # N x D
        return (F.normalize(f, dim=1) if normalize else f).cpu().numpy()

    def embed(self, images: Sequence[ImageLike] | ImageLike, batch_size: int = 64, normalize: bool = True,
              output: str = "numpy", progress: bool = False, mean: np.ndarray | None = None,
              ) -> np.ndarray | torch.Tensor:
        """Embed images (PIL images, paths, uint8 HWC/CHW arrays or tensors): N x D float32.

        ``normalize``: L2-normalize each vector (cosine = inner product), else the backbone's pooled features
        (through the run's whitening when the file carries one: ``Embedder.load(..., whiten=False)`` skips it);
        ``output``: "numpy" (an ndarray) or "torch" (a CPU tensor); ``progress``: a progress bar on stderr;
        ``mean``: a collection's mean embedding (D, e.g. ``ImageIndex.mean``): the vectors are centred on it
        (:func:`center`), so unrelated images score near 0; by default the raw output is returned.
        """
        if mean is not None and np.shape(mean) != (self.dim,):
            raise UserError(f"embed(mean=...) has shape {np.shape(mean)}, this backbone embeds {self.dim}-d: pass "
                            "the mean of vectors made by the same backbone (ImageIndex.mean)")
        if output not in ("numpy", "torch"):
            raise UserError(f"embed(output={output!r}): use output='numpy' or output='torch'")
        if isinstance(images, (str, Path, Image.Image)) or (
            isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim in (2, 3)
        ):
            images = [images]
        if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
            images = list(images)
        images = list(images)
        if not images:
            raise UserError("embed() got no images: pass a non-empty list")
        from tqdm.auto import tqdm

        out = []
        with tqdm(total=len(images), disable=not progress, unit="img", desc="embedding") as bar:
            for start in range(0, len(images), batch_size):
                squares = np.stack([self._to_square(im) for im in images[start : start + batch_size]])
                out.append(self.embed_squares(squares, normalize))
                bar.update(len(squares))
        vectors = np.concatenate(out)
        if mean is not None:
            vectors = center(vectors, mean) if normalize else vectors - np.asarray(mean, np.float32)
        return torch.from_numpy(vectors) if output == "torch" else vectors

    def encode(self, images: Sequence[ImageLike] | ImageLike, batch_size: int = 32,
               show_progress_bar: bool | None = None, convert_to_numpy: bool = True, convert_to_tensor: bool = False,
               normalize_embeddings: bool = True) -> np.ndarray | torch.Tensor | list[torch.Tensor]:
        """:meth:`embed` under sentence-transformers' names, for code written against ``SentenceTransformer.encode``:
        one image in, one vector out (D); a list in, N x D. ``convert_to_tensor``: a torch tensor (before
        ``convert_to_numpy``); neither: a list of tensors. Unlike sentence-transformers, ``normalize_embeddings``
        is True by default: the index and its searches are in the cosine space of unit vectors."""
        one = isinstance(images, (str, Path, Image.Image)) or (
            isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim in (2, 3))
        vectors = self.embed(images, batch_size=batch_size, normalize=normalize_embeddings, output="torch",
                             progress=bool(show_progress_bar))  # N x D
        if convert_to_tensor:
            return vectors[0] if one else vectors
        if convert_to_numpy:
            return vectors[0].numpy() if one else vectors.numpy()
        return vectors[0] if one else list(vectors)

    def embed_folder(
        self, root: str | Path, batch_size: int = 64, workers: int | None = None, progress: bool = True,
        files: Sequence[str] | None = None, decoder: str = "auto", exclude: Sequence[str] = (),
    ) -> Iterator[tuple[list[str], np.ndarray, list[tuple[str, str]]]]:
        """Stream ``(paths, vectors, failures)`` batches over a folder (recursive), for any size of collection.

        ``paths`` are relative to ``root``; ``vectors`` is len(paths) x D; ``failures`` lists
        ``(path, reason)`` of the files in this batch that could not be read (they never stop the batch).
        Decoding and resizing run in ``workers`` threads ahead of the model (PIL releases the GIL).
        ``decoder``: "pil", "torchvision" (JPEGs decoded in batches by ``torchvision.io.decode_jpeg`` on
        the embedder's device, resized there) or "auto" (torchvision on a GPU, PIL on a CPU). ``exclude``:
        ``--exclude`` patterns of folders and files never read (:mod:`moco.excludes`; with ``files=None``).
        """
        if decoder not in ("auto", "pil", "torchvision"):
            raise UserError(f"decoder {decoder!r} is not one of auto, pil, torchvision")
        on_device = decoder == "torchvision" or (decoder == "auto" and self.device.type == "cuda")
        root = Path(root)
        names = list(files) if files is not None else scan_images(root, exclude)
        workers = workers or min(8, os.cpu_count() or 1)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(names), disable=not progress, unit="img", desc="embedding")

        def decode(name: str) -> tuple[str, np.ndarray | torch.Tensor | None, str]:
            try:
                if on_device and name.lower().endswith((".jpg", ".jpeg")):  # bytes, decoded in batches
                    return name, torch.from_numpy(np.frombuffer(read_image_bytes(root / name), np.uint8).copy()), ""
                return name, load_square_u8(root / name, self.resize), ""
            except ImageDecodeError as e:
                return name, None, e.reason
            except Exception as e:  # noqa: BLE001 - one bad file never stops the batch
                return name, None, f"{type(e).__name__}: {e}"

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            pending = [pool.submit(decode, n) for n in names[: 2 * batch_size]]
            queued = len(pending)
            while pending:
                batch, pending = pending[:batch_size], pending[batch_size:]
                more = names[queued : queued + batch_size]  # keep two batches decoding ahead
                pending += [pool.submit(decode, n) for n in more]
                queued += len(more)
                results = [f.result() for f in batch]
                if on_device:
                    results = self._decode_jpegs_on_device(root, results)
                ok = [(n, a) for n, a, _ in results if a is not None]
                failures = [(n, why) for n, a, why in results if a is None]
                for n, why in failures:
                    logger.warning("skipping %s: %s", n, why)
                vectors = (
                    self.embed_squares(np.stack([a for _, a in ok])) if ok else np.zeros((0, self.dim), np.float32)
                )
                bar.update(len(results))
                yield [n for n, _ in ok], vectors, failures
        bar.close()

    def _decode_jpegs_on_device(self, root: Path, results: list[tuple[str, Any, str]]) -> list[tuple[str, Any, str]]:
        """Replace raw JPEG bytes by decoded ``resize`` squares: one batched decode on the device."""
        raw = [i for i, (_, a, _) in enumerate(results) if isinstance(a, torch.Tensor) and a.dtype == torch.uint8
               and a.ndim == 1]
        if not raw:
            return results
        import torchvision  # here only: importing it imports torch._dynamo, a second's work for one photo

        try:
            images = torchvision.io.decode_jpeg([results[i][1] for i in raw], mode=torchvision.io.ImageReadMode.RGB,
                                                device=self.device, apply_exif_orientation=True)
        except RuntimeError as e:  # a corrupt JPEG fails the whole batch: fall back to PIL per file
            logger.debug("batched JPEG decode failed (%s); decoding this batch with PIL", e)
            images = [None] * len(raw)
        out = list(results)
        for i, img in zip(raw, images):
            name = results[i][0]
            if img is None:
                try:
                    out[i] = (name, load_square_u8(root / name, self.resize), "")
                except ImageDecodeError as e:
                    out[i] = (name, None, e.reason)
                continue
            out[i] = (name, _square_on_device(img, self.resize), "")
        return out
