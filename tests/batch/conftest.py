from tests.support.batches import batch_names

__all__ = ["batch_names"]
