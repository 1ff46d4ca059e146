"""moco.data: photos in. A folder scanned and each photo decoded safely (:mod:`~moco.data.photos`), decoded once
into a square uint8 cache (:mod:`~moco.data.cache`), two augmented views of each (:mod:`~moco.data.augment`), and
the generated sample collection (:mod:`~moco.data.sample`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "scan_images": "photos", "scan_photos": "photos", "Scan": "photos", "photo_info": "photos",
    "load_rgb": "photos", "load_square_u8": "photos", "square_u8": "photos",
    "ImageDecodeError": "photos", "ImageCache": "cache", "build_cache": "cache", "cache_size_for": "cache",
    "two_views": "augment", "center_view": "augment", "make_sample_collection": "sample",
})
