"""Whitening of an embedding collection: centre on its mean, decorrelate with its shrunk covariance.

Pooled ReLU features sit in a narrow cone (centring fixes that: :func:`moco.embed.center`) and a few
directions carry most of their variance, so a cosine over them mostly compares those directions.
Whitening (PCA whitening, as in image retrieval since Jégou & Chum 2012) scales every principal
direction to unit variance before the cosine. The covariance is shrunk towards a multiple of the
identity by the Ledoit-Wolf estimate (Ledoit & Wolf 2004, the formula of scikit-learn's
``ledoit_wolf_shrinkage``): no setting to tune, and for a collection with fewer vectors than dimensions
the shrinkage grows towards 1, where whitening falls back to plain centring.

A run's whitening (``moco train --whiten``) is fitted on, and applied to, the *mirror-averaged* features of
each photo (:func:`mirror_features`: the sum of the normalized features of the photo and of its mirror image).
Every preset trains with random horizontal flips, so the part of a feature that changes sign under a flip is
nuisance to the network; whitening scales every direction to unit variance, nuisance included, and removing
that part first lifted kNN on two sets of three (BENCHMARKS.md, seventh round, has the figures).

On ResNets it is also fitted on the pooled outputs of the earlier stages beside the last (:data:`STAGES`, the
multi-layer descriptors of image retrieval): at 32 px the last stage's map is 1 x 1, and what the earlier, finer
maps keep lifted kNN on every set that was not saturated (BENCHMARKS.md, ninth round). The whitening balances
the stages' scales, so they are concatenated as they are. A fit on fewer photos than about twice their dimensions
loses with them, so ``--whiten-stages auto`` (the cpu preset) pools them only from there (``moco.training.whitening``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moco.edges import DIM as EDGE_DIM
from moco.edges import EDGES, WEIGHT, edge_layout

if TYPE_CHECKING:  # torch is imported where features are made: an index's searches and duplicates need only numpy
    import torch

__all__ = ["STAGES", "Whitening", "embedding_features", "fit_whitening", "ledoit_wolf_shrinkage", "mirror_features",
           "resnet_stages", "feature_widths", "whiten_features", "fit_space", "MAX_MATRIX_ENTRY", "save_space",
           "load_space", "SPACE_FILE", "apply_space", "with_edges", "fit_features", "features_text"]

STAGES = ("layer1", "layer2", "layer3")  # ResNet stages before the last, pooled beside the backbone's output
SAME_AS_MEAN = 1e-6  # a feature this close to the space's mean has no direction of its own: it keeps its own
SPACE_FILE = "space.safetensors"  # an index's space (beside index.faiss) and a timm export's, for other doors
MAX_MATRIX_ENTRY = 1e6  # a fitted matrix with larger entries divides by a variance of ~0: a degenerate fit

logger = logging.getLogger(__name__)


def whiten_features(v: torch.Tensor, mean: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
    """``(v - mean) @ matrix`` of L2-normalized features ``v`` (N x D), not normalized again (``matrix`` None:
    centring only): what :class:`Whitening` computes in numpy, with the same input, on ``v``'s device (``mean``: D,
    ``matrix``: D x D). A row within :data:`SAME_AS_MEAN` of the mean keeps ``v``: no vector is ever zero."""
    import torch

    c = v - mean  # N x D
    w = c if matrix is None else c @ matrix  # N x D
    same = c.norm(dim=1, keepdim=True) < SAME_AS_MEAN  # N x 1
    return torch.where(same, v, w)


def mirror_features(backbone: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``normalize(backbone(x)) + normalize(backbone(mirror(x)))`` (N x D float32, not normalized again) of views
    ``x`` (N x 3 x s x s), in one forward pass of the 2N views (flip and cat keep ``x``'s memory format)."""
    return embedding_features(backbone, x, mirror=True)


def resnet_stages(backbone: torch.nn.Module) -> tuple[str, ...]:
    """:data:`STAGES` where ``backbone`` has them all (torchvision's and timm's ResNets), else ()."""
    import torch

    return STAGES if all(isinstance(getattr(backbone, s, None), torch.nn.Module) for s in STAGES) else ()


@contextlib.contextmanager
def _tapped(backbone: torch.nn.Module, stages: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
    """While open, each forward pass of ``backbone`` leaves each named stage's output in the dict it yields."""
    outs: dict[str, torch.Tensor] = {}
    hooks = [getattr(backbone, name).register_forward_hook(lambda _m, _i, out, name=name: outs.__setitem__(name, out))
             for name in stages]
    try:
        yield outs
    finally:
        for h in hooks:
            h.remove()


def embedding_features(backbone: torch.nn.Module, x: torch.Tensor, mirror: bool = False,
                       stages: Sequence[str] = ()) -> torch.Tensor:
    """What a whitening is fitted on and applied to, for views ``x`` (N x 3 x s x s): the global average of each
    named stage's output (N x C_i), then the backbone's output (N x D), concatenated (N x D', float32); with
    ``mirror``, ``normalize(.)`` of it summed over each view and its mirror image (one forward pass of 2N views).
    With :data:`~moco.edges.EDGES` among the stages (the last), the network's part and the views' edge layout
    (:func:`moco.edges.edge_layout`) each L2-normalized, the edges last."""
    import torch

    if mirror:
        x = torch.cat([x, x.flip(3)])  # 2N x 3 x s x s
    tapped = [name for name in stages if name != EDGES]
    with _tapped(backbone, tapped) as outs:
        f = backbone(x).float()  # (2)N x D
    if tapped:
        f = torch.cat([*(outs[name].float().mean((2, 3)) for name in tapped), f], 1)  # (2)N x D'
    if EDGES in stages:
        norm = torch.nn.functional.normalize
        f = torch.cat([norm(f, dim=1), norm(edge_layout(x), dim=1)], 1)  # (2)N x (D' + E)
    if not mirror:
        return f
    return torch.nn.functional.normalize(f, dim=1).unflatten(0, (2, -1)).sum(0)  # N x D'


def features_text(stages: Sequence[str]) -> str:
    """" with the pooled layer1/layer2/layer3 and the photos' edge layout": what a whitening's ``stages`` add to the
    backbone's output, for messages ("" for none)."""
    pooled = [name for name in stages if name != EDGES]
    return (f" with the pooled {'/'.join(pooled)}" if pooled else "") + (
        f"{' and' if pooled else ' with'} the photos' edge layout" if EDGES in stages else "")


def feature_widths(backbone: torch.nn.Module, stages: Sequence[str], image_size: int) -> tuple[tuple[int, ...], int]:
    """Channels of each named stage's output (:data:`~moco.edges.EDGES`: its width), and the width D of the
    backbone's: one forward pass of a blank ``image_size`` view in eval mode."""
    import torch

    was_training = backbone.training
    p = next(backbone.parameters())
    tapped = [name for name in stages if name != EDGES]
    with torch.no_grad(), _tapped(backbone.eval(), tapped) as outs:
        f = backbone(torch.zeros(1, 3, image_size, image_size, device=p.device, dtype=p.dtype))  # 1 x D
    backbone.train(was_training)
    return tuple(EDGE_DIM if name == EDGES else int(outs[name].shape[1]) for name in stages), int(f.shape[1])


@dataclass(frozen=True)
class Whitening:
    """``normalize((normalize(f) - mean) @ matrix)``: the map from a backbone's features ``f`` to the vectors we
    compare (an embedding space). ``matrix`` None: centring only. Which features (``mirror``, ``stages``) is part
    of it: :meth:`features` computes them."""

    mean: np.ndarray  # D' float32
    matrix: np.ndarray | None  # D' x D' float32: eigenvectors of the shrunk covariance scaled by eigenvalue^-1/2
    shrinkage: float  # 0 (the sample covariance) .. 1 (a multiple of the identity: centring only)
    count: int  # vectors it was fitted on
    mirror: bool = False  # fitted on mirror_features: embeddings average each photo with its mirror image first
    stages: tuple[tuple[str, int], ...] = ()  # (name, channels) of the stages pooled before the backbone's output
    source: str = "training photos"  # what it was fitted on: "training photos", "collection", ...

    @property
    def dim(self) -> int:
        """D': the width of the features it whitens (the backbone's D plus the pooled stages' channels)."""
        return int(self.mean.shape[0])

    @property
    def whitened(self) -> bool:
        """Whether it whitens (a matrix) or only centres; with the edge layout, whether it whitens the network's
        part (the matrix of a centring beside the edges only scales the two parts)."""
        m = self.without_edges().matrix
        return m is not None and (m is self.matrix or not np.allclose(m, m[0, 0] * np.eye(len(m)), atol=1e-7))

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The names of the stages pooled before the backbone's output (``backbone.layer1``, ...)."""
        return tuple(name for name, _ in self.stages)

    def without_edges(self) -> Whitening:
        """The same map of the network's part alone: the edge layout (:data:`~moco.edges.EDGES`, the last stage)
        left out of its mean, matrix and stages."""
        if EDGES not in self.stage_names:
            return self
        d = self.dim - dict(self.stages)[EDGES]
        return replace(self, mean=self.mean[:d], matrix=None if self.matrix is None else self.matrix[:d, :d],
                       stages=tuple(st for st in self.stages if st[0] != EDGES))

    @property
    def digest(self) -> str:
        """16 hex digits naming the map (its mean, matrix and features): two spaces with one digest are one space."""
        h = hashlib.blake2b(digest_size=8)
        h.update(np.asarray(self.mean, "<f4").tobytes())
        if self.matrix is not None:
            h.update(np.asarray(self.matrix, "<f4").tobytes())
        h.update(repr((self.mirror, tuple(self.stages))).encode())
        return h.hexdigest()

    def describe(self) -> dict[str, Any]:
        """What the vectors it makes are (plain types, for metadata): width, whitened, centred, L2-normalized, the
        features (mirror image, pooled stages) and what it was fitted on."""
        return {"width": self.dim, "whitened": self.whitened, "centred": True, "normalized": True,
                "mirror": bool(self.mirror), "stages": [[n, int(c)] for n, c in self.stages],
                "fitted_on": self.source, "count": int(self.count), "shrinkage": round(float(self.shrinkage), 6),
                "digest": self.digest}

    def features(self, backbone: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The features of views ``x`` (N x 3 x s x s) this whitening applies to: N x D' float32
        (:func:`embedding_features` with its mirror image and stages)."""
        f = embedding_features(backbone, x, self.mirror, self.stage_names)  # N x D'
        if f.shape[1] != self.dim:
            raise ValueError(f"the backbone's features with stages {self.stages or 'none'} are {f.shape[1]}-d, the "
                             f"whitening's {self.dim}-d: it belongs to another backbone")
        return f

    def __call__(self, vectors: np.ndarray) -> np.ndarray:
        """Whitened (or centred), L2-normalized rows (N x D' float32) of L2-normalized features; a row within
        :data:`SAME_AS_MEAN` of the mean keeps its own direction, so no row is ever zero."""
        v = np.atleast_2d(np.asarray(vectors, np.float32))  # N x D'
        c = v - self.mean[None, :]  # N x D'
        w = c if self.matrix is None else c @ self.matrix  # N x D'
        same = np.linalg.norm(c, axis=1) < SAME_AS_MEAN  # N
        w[same] = v[same]
        norms = np.linalg.norm(w, axis=1, keepdims=True)  # N x 1
        return (w / np.maximum(norms, 1e-12)).astype(np.float32)

    def state(self) -> dict[str, Any]:
        """Tensors and numbers (what ``torch.load(weights_only=True)`` reads back), for a checkpoint."""
        import torch

        out = {"mean": torch.from_numpy(self.mean.copy()), "shrinkage": float(self.shrinkage),
               "count": int(self.count), "mirror": bool(self.mirror), "source": self.source,
               "stages": [[name, int(c)] for name, c in self.stages]}
        out["matrix"] = None if self.matrix is None else torch.from_numpy(self.matrix.copy())  # None: centring only
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any], dim: int, where: str) -> Whitening:
        """The whitening :meth:`state` wrote, checked against the backbone's feature dimension ``dim`` (plus the
        channels of the stages it pools); ``matrix`` None: centring only."""
        try:
            mean = np.asarray(state["mean"], np.float32)  # D'
            matrix = None if state["matrix"] is None else np.asarray(state["matrix"], np.float32)  # D' x D'
            shrinkage, count = float(state.get("shrinkage", 0.0)), int(state.get("count", 0))
            mirror = bool(state.get("mirror", False))  # files written before it: plain features
            stages = tuple((str(name), int(c)) for name, c in state.get("stages") or ())  # before them: none
            source = str(state.get("source") or "training photos")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: the whitening is damaged ({e})") from None
        full = dim + sum(c for _, c in stages)
        bad_matrix = matrix is not None and (matrix.shape != (full, full) or not np.isfinite(matrix).all())
        if mean.shape != (full,) or bad_matrix or not np.isfinite(mean).all():
            pooled = f" and its stages {full}-d" if stages else ""
            shape = None if matrix is None else matrix.shape
            raise ValueError(f"{where}: the whitening has shapes {mean.shape} and {shape} (or non-finite "
                             f"values), the backbone embeds {dim}-d{pooled}")
        return cls(mean, matrix, shrinkage, count, mirror, stages, source)


def ledoit_wolf_shrinkage(xc: np.ndarray) -> float:
    """The Ledoit-Wolf shrinkage (0..1) of the covariance of centred rows ``xc`` (N x D) towards mu * I."""
    n, d = xc.shape
    x2 = xc**2  # N x D
    trace = x2.sum(0) / n  # D: the sample variances
    mu = trace.sum() / d  # the mean variance
    beta_ = float((x2.T @ x2).sum())  # sum over i, j of sum_n x_ni^2 x_nj^2
    delta_ = float(((xc.T @ xc) ** 2).sum()) / n**2  # squared Frobenius norm of the sample covariance
    beta = (beta_ / n - delta_) / (d * n)
    delta = (delta_ - 2 * mu * trace.sum() + d * mu**2) / d  # ||S - mu I||_F^2 / d
    if delta <= 0:
        return 1.0
    return float(min(beta, delta) / delta)


def fit_whitening(vectors: np.ndarray, shrinkage: float | None = None, max_rows: int | None = None) -> Whitening:
    """The whitening of ``vectors`` (N x D, N >= 2): their mean and the shrunk covariance's
    ``eigenvectors * eigenvalues^-1/2``; ``shrinkage`` None: the Ledoit-Wolf estimate, else that value (0..1).

    ``max_rows``: fit on that many rows drawn without replacement (seeded: the same rows every time) when there
    are more, which bounds the float64 working copies (a few times ``max_rows x D x 8`` bytes).
    """
    rows = np.asarray(vectors)
    if rows.ndim != 2 or len(rows) < 2:
        raise ValueError(f"whitening needs at least 2 vectors of the same dimension, got shape {rows.shape}")
    if shrinkage is not None and not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must be in [0, 1] (or None for Ledoit-Wolf), got {shrinkage}")
    if max_rows is not None and len(rows) > max_rows >= 2:
        rows = rows[np.sort(np.random.default_rng(0).choice(len(rows), max_rows, replace=False))]  # max_rows x D
    v = rows.astype(np.float64)  # N x D
    mean = v.mean(0)  # D
    xc = v - mean  # N x D
    d = v.shape[1]
    a = ledoit_wolf_shrinkage(xc) if shrinkage is None else float(shrinkage)
    cov = xc.T @ xc / len(v)  # D x D
    shrunk = (1 - a) * cov + a * (np.trace(cov) / d) * np.eye(d)  # D x D
    ev, vecs = np.linalg.eigh(shrunk)  # D, D x D
    floor = max(float(ev.max()), 1e-30) * 1e-12  # a zero-variance collection (all rows equal) stays finite
    matrix = vecs / np.sqrt(np.maximum(ev, floor))[None, :]  # D x D
    return Whitening(mean.astype(np.float32), matrix.astype(np.float32), a, len(v))  # count: the rows fitted


def with_edges(v: np.ndarray, fit_net: Callable[[np.ndarray], Whitening]) -> Whitening:
    """The space of L2-normalized features ``v`` (N x (D' + E)) whose last E columns are the edge layout
    (:data:`~moco.edges.EDGES`): the network's part mapped by ``fit_net(v[:, :D'])`` (a space fitted on it alone: no
    whitening mixes the two parts), the edges centred on their own mean, and each part scaled so that its centred
    rows are on average sqrt(1 - :data:`~moco.edges.WEIGHT`) and sqrt(WEIGHT) long (a block-diagonal matrix). Centred
    together instead, the network's part would outweigh the edges, whose histograms lie closer to their mean: 10
    light/dark twins of 16 first instead of 13 (bench/NOTES.md, twenty-second session). Mirror and stages: unset."""
    v = np.asarray(v, np.float32)
    d = v.shape[1] - EDGE_DIM
    net = fit_net(v[:, :d])  # the network's part: D'
    mn = np.eye(d, dtype=np.float32) if net.matrix is None else net.matrix  # D' x D'
    edge_mean = v[:, d:].mean(0) if len(v) else np.zeros(EDGE_DIM, np.float32)  # E

    def scale(c: np.ndarray, share: float) -> float:  # c: N x k centred rows
        size = float(np.linalg.norm(c, axis=1).mean()) if len(c) else 0.0
        return float(np.sqrt(share)) / size if size > 1e-6 else float(np.sqrt(share))

    matrix = np.zeros((d + EDGE_DIM, d + EDGE_DIM), np.float32)  # (D' + E) x (D' + E)
    matrix[:d, :d] = mn * scale((v[:, :d] - net.mean) @ mn, 1.0 - WEIGHT)
    matrix[d:, d:] = np.eye(EDGE_DIM, dtype=np.float32) * scale(v[:, d:] - edge_mean, WEIGHT)
    return replace(net, mean=np.concatenate([net.mean, edge_mean]).astype(np.float32), matrix=matrix)


def fit_features(v: np.ndarray, stages: Sequence[tuple[str, int]], fit_net: Callable[[np.ndarray], Whitening]
                 ) -> Whitening:
    """``fit_net(v)``, or where ``stages`` end with the edge layout :func:`with_edges` (the network's part by
    ``fit_net``); mirror and stages as ``fit_net`` sets them."""
    return with_edges(v, fit_net) if EDGES in (name for name, _ in stages) else fit_net(v)


def fit_space(features: np.ndarray, how: str, base: Whitening | None = None, source: str = "collection",
              max_rows: int | None = 20_000) -> Whitening:
    """The embedding space of a collection's L2-normalized ``features`` (N x D'), centred on their mean and
    ``how``: "whitened" by their own shrunk covariance (:func:`fit_whitening`), "training": with ``base``'s matrix
    (a training-time whitening, its mean replaced by the collection's), "centred": nothing more. The mirror image
    and stages come from ``base``.

    Degenerate statistics (under 2 photos, all photos alike, a matrix that divides by a variance of ~0) fall
    back to centring with a warning; :meth:`Whitening.__call__` keeps a feature equal to the mean as it is.
    """
    if how not in ("whitened", "training", "centred"):
        raise ValueError(f"fit_space(how={how!r}): use 'whitened', 'training' or 'centred'")
    v = np.atleast_2d(np.asarray(features, np.float32))  # N x D'
    mirror, stages = (base.mirror, base.stages) if base is not None else (False, ())
    if base is not None and EDGES in base.stage_names:  # the network's part by ``how``, the edges beside it
        net = base.without_edges()
        space = with_edges(v, lambda vn: fit_space(vn, how, net, source, max_rows))
        return replace(space, count=len(v), mirror=mirror, stages=stages, source=space.source)
    mean = v.mean(0) if len(v) else np.zeros(v.shape[1], np.float32)  # D'
    spread = float(((v - mean) ** 2).sum(1).mean()) if len(v) else 0.0  # mean squared distance to the mean
    centred = Whitening(mean.astype(np.float32), None, 1.0, len(v), mirror, stages, source)
    if how == "centred":
        return centred
    if len(v) < 2 or spread < 1e-8:
        logger.warning("embedding space: %d photo(s) %s: centring only, nothing to whiten", len(v),
                       "are too few" if len(v) < 2 else "are all alike (no spread)")
        return centred
    if how == "whitened":
        w = fit_whitening(v, max_rows=max_rows)
        if not np.isfinite(w.matrix).all() or float(np.abs(w.matrix).max()) > MAX_MATRIX_ENTRY:
            logger.warning("embedding space: the whitening of %d photos is degenerate (a direction of ~0 variance): "
                           "centring only", len(v))
            return centred
        return replace(w, mean=mean.astype(np.float32), count=len(v), mirror=mirror, stages=stages, source=source)
    if base is None or base.matrix is None:
        raise ValueError("fit_space(how='training') needs a base whitening with a matrix")
    return replace(centred, matrix=base.matrix, shrinkage=base.shrinkage,
                   source=f"{source}; matrix of the {base.source}")


def save_space(space: Whitening, path: str | Path, backbone_sha256: str, **extra: str) -> None:
    """Write ``space`` to a ``.safetensors`` file (its mean and matrix; what it is in the metadata), atomically:
    what ``Embedder.load(B, space=FILE)`` and :func:`apply_space` read."""
    import json

    from safetensors.numpy import save

    from moco.files import atomic_write

    tensors = {"mean": np.ascontiguousarray(space.mean, np.float32)}
    if space.matrix is not None:
        tensors["matrix"] = np.ascontiguousarray(space.matrix, np.float32)
    meta = {"format": "moco-retrieval/space", "space": json.dumps(space.describe()), "backbone_sha256": backbone_sha256,
            **extra}
    data = save(tensors, metadata=meta)
    atomic_write(Path(path), lambda f: f.write(data))


def load_space(path: str | Path) -> tuple[Whitening, dict[str, str]]:
    """The space :func:`save_space` wrote, and the file's metadata; ValueError naming the file when it is not one."""
    import json

    from moco.files import read_safetensors

    path = Path(path)
    try:
        tensors, meta = read_safetensors(path, framework="np")
        if meta.get("format") != "moco-retrieval/space":
            raise ValueError("not a moco-retrieval space file")
        info = json.loads(meta["space"])
        stages = [(str(n), int(c)) for n, c in info.get("stages") or []]
        state = {"mean": tensors["mean"], "matrix": tensors.get("matrix"), "shrinkage": info.get("shrinkage") or 0.0,
                 "count": info.get("count") or 0, "mirror": info.get("mirror"), "stages": stages,
                 "source": info.get("fitted_on") or "collection"}
        return Whitening.from_state(state, int(info["width"]) - sum(c for _, c in stages), str(path)), meta
    except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        missing = isinstance(e, FileNotFoundError)
        raise ValueError(f"{path} {'does not exist' if missing else f'is not a readable embedding space ({e})'}: "
                         "`moco index update IDX` writes an index's again; a timm folder has one when its export "
                         "had a space: `moco export CHECKPOINT --format timm --space IDX` gives it the space of "
                         "index IDX (a run fitted with --whiten carries its own)") from None


def apply_space(model: torch.nn.Module, x: torch.Tensor, space: str | Path | Whitening) -> torch.Tensor:
    """The embedding of views ``x`` (N x 3 x s x s, preprocessed as the model's ``pretrained_cfg`` says) by a
    backbone ``model`` (e.g. ``timm.create_model("local-dir:DIR", pretrained=True)`` of ``moco export --format
    timm``) in ``space`` (``DIR/space.safetensors``, or a :class:`Whitening`): the same vectors as
    ``moco.Embedder`` (N x D' float32, L2-normalized)."""
    w = load_space(Path(space) / SPACE_FILE if Path(str(space)).is_dir() else space)[0] if not isinstance(
        space, Whitening) else space
    import torch

    with torch.no_grad():
        f = w.features(model.eval(), x)  # N x D'
        mat = None if w.matrix is None else torch.from_numpy(w.matrix).to(f.device)
        v = torch.nn.functional.normalize(f, dim=1)  # N x D'
        return torch.nn.functional.normalize(whiten_features(v, torch.from_numpy(w.mean).to(f.device), mat), dim=1)
