"""The InfoNCE view of one image: its two training views, the positive, and the negatives that sit closest.

MoCo's loss for a query q with positive key k+ and negatives k_1..k_K is
``-log softmax([q.k+, q.k_1, ..., q.k_K] / T)[0]``. For an uploaded image (or an indexed photo, by its
catalog id) the Negatives tab computes exactly those numbers, from one of two sources:

- ``QueueNegatives`` (a training checkpoint is given; :mod:`~app.page.negatives.from_queue`): the checkpoint's own
  augmentation recipe makes the query and key views; q comes from the query encoder (projector, and predictor
  for v3), k+ from the momentum (key) encoder, and the negatives are the saved queue of K keys, each with the id
  of the training image it came from. This is the space the loss lives in.
- ``IndexNegatives`` (no checkpoint, or one without a queue; :mod:`~app.page.negatives.from_index`): both views go
  through the exported backbone, and every other image of the index is a negative, in the centred backbone space of
  search scores (:meth:`index.search.image_index.ImageIndex.to_space`).

Both fill a ``NegativesView`` (:mod:`~app.page.negatives.view`: the view, the loss's numbers, and the evidence that
flags a negative as a likely false negative).
"""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "NegativesView": "view", "Negative": "view", "info_nce_numbers": "view", "REASONS": "view",
    "QueueNegatives": "from_queue", "IndexNegatives": "from_index",
})
