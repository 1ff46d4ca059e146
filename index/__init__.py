"""index: FAISS image index over a photo collection (coming with the index issue)."""

__all__: list[str] = []
