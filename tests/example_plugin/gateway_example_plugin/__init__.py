"""An example third-party plugin: adds a configured response header to every answer."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from gateway.pipeline import ModelResponse, Plugin, RequestContext


class HeaderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "x-example-plugin"
    value: str = "on"


class HeaderPlugin(Plugin):
    Config = HeaderConfig

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        ctx.response_headers[self.config.name] = self.config.value
        return None
