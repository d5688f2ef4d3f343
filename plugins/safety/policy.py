"""The compiled form of the config: one ``Policy`` per model that has overrides, plus the default.

Built once in ``start()`` (regexes, RE2 sets, detect-secrets patterns); a request only looks its
policy up by model name.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugins.safety.config import LimitsConfig, RuleConfig, SafetyConfig
from plugins.safety.rules import RuleSet, build_rule
from plugins.safety.secret_keys import SecretPattern, load_secret_patterns


@dataclass(frozen=True, slots=True)
class Policy:
    enabled: bool
    limits: LimitsConfig
    input: RuleSet
    output: RuleSet
    tokenizer: str | None  # tokenizer.json path; None: no token limit


def _rule_sets(rules: list[RuleConfig], secrets: list[SecretPattern]) -> tuple[RuleSet, RuleSet]:
    built = [(cfg, build_rule(cfg, secrets)) for cfg in rules]
    return (
        RuleSet([rule for cfg, rule in built if "input" in cfg.apply_to]),
        RuleSet([rule for cfg, rule in built if "output" in cfg.apply_to]),
    )


class Policies:
    """Model name -> Policy. ``tokenizer`` paths with ``{model}`` are resolved per model on lookup."""

    def __init__(self, config: SafetyConfig) -> None:
        needs_secrets = any(
            r.kind == "secrets"
            for rules in [config.rules, *(m.rules or [] for m in config.models.values())]
            for r in rules
        )
        secrets, self.skipped_secret_types = load_secret_patterns() if needs_secrets else ([], [])
        self._config = config
        default_in, default_out = _rule_sets(config.rules, secrets)
        self._default = (default_in, default_out)
        self._by_model: dict[str, Policy] = {}
        for name, override in config.models.items():
            if override.rules is None:
                rule_in, rule_out = default_in, default_out
            else:
                rule_in, rule_out = _rule_sets(override.rules, secrets)
            self._by_model[name] = self._policy(name, rule_in, rule_out, enabled=override.enabled)

    def _policy(self, model: str, rule_in: RuleSet, rule_out: RuleSet, *, enabled: bool = True) -> Policy:
        limits = self._config.limits_for(model)
        tokenizer = self._config.tokenizer_for(model) if limits.max_prompt_tokens is not None else None
        return Policy(enabled, limits, rule_in, rule_out, tokenizer)

    def get(self, model: str) -> Policy:
        policy = self._by_model.get(model)
        if policy is None:
            # A model without overrides: the default rules and limits, its own tokenizer path.
            policy = self._policy(model, *self._default)
            self._by_model[model] = policy
        return policy

    def tokenizer_paths(self) -> list[str]:
        return sorted({p.tokenizer for p in self._by_model.values() if p.tokenizer})
