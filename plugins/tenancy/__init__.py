"""Tenancy: API keys, per-key and per-tenant rate limits, and token budgets, shared through Redis."""

from plugins.tenancy.plugin import TenancyPlugin

__all__ = ["TenancyPlugin"]
