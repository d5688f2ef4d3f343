"""Which config keys hold credentials: whole words of the key, not any substring."""

from __future__ import annotations

import pytest

from gateway.server.routes.admin import REDACTED, is_secret_key, redact


@pytest.mark.parametrize(
    "key",
    ["password", "admin_token", "adminToken", "api_key", "api-keys", "OPENAI_API_KEY", "client_secret", "pepper",
     "keys", "private", "ssh_private_key", "auth", "credentials", "bearer-token"],
)  # fmt: skip
def test_credential_keys_are_masked(key: str) -> None:
    assert is_secret_key(key, "value")
    assert redact({key: "value"}) == {key: REDACTED}


@pytest.mark.parametrize(
    "key",
    ["max_tokens", "tokens_per_minute", "num_speculative_tokens", "tokenizer", "key_prefix", "keepalive_s",
     "max_prompt_tokens", "passthrough", "authority", "monkeys", "threshold"],
)  # fmt: skip
def test_limits_and_settings_that_merely_contain_a_word_are_shown(key: str) -> None:
    assert not is_secret_key(key, 2048)
    assert redact({key: 2048}) == {key: 2048}


def test_a_switch_is_shown_and_an_unset_credential_stays_unset() -> None:
    assert redact({"auth": True, "token": None, "password": ""}) == {"auth": True, "token": None, "password": ""}
