"""Response caching in Redis (entry point ``plugins.cache:CachePlugin``, name ``cache``)."""

from plugins.cache.config import CacheConfig
from plugins.cache.plugin import CachePlugin

__all__ = ["CacheConfig", "CachePlugin"]
