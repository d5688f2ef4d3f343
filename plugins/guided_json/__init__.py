"""Guided JSON output: every way clients ask for constrained output, compiled with outlines at the
gateway, enforced by the workers, validated on the way back. See ``plugin`` for the flow."""

from plugins.guided_json.plugin import GuidedJSONPlugin

__all__ = ["GuidedJSONPlugin"]
