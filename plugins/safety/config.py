"""The safety plugin's ``config:`` section: limits, rules, the optional classifier and the stream
hold-back, as a global default with per-model overrides.

A per-model entry (keyed by the model's ``name`` in ``config.yaml``, not an alias) overrides the
global ``limits`` field by field, replaces the global ``rules`` list when it gives one, and may name
the model's tokenizer. Everything here is validated before a config goes live; regexes are compiled
in ``start()`` so a bad pattern refuses the config that brought it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Action = Literal["block", "redact", "log"]
Direction = Literal["input", "output"]
Family = Literal["override", "roleplay", "extraction"]
RuleKind = Literal["pattern", "words", "email", "phone", "card", "iban", "gov_id", "ip", "secrets", "injection"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """Request-shape limits; ``None`` turns a limit off. Over a limit: 400 naming the field."""

    max_body_bytes: int | None = Field(None, ge=1, description="largest request body")
    max_messages: int | None = Field(None, ge=1, description="most messages in a chat request")
    max_prompt_chars: int | None = Field(None, ge=1, description="longest prompt text, in characters")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="counted with the model's tokenizer on the prompt text (chat template excluded); "
        "a prompt given as token ids counts one token per id",
    )
    max_tokens: int | None = Field(None, ge=1, description="applies to max_tokens and max_completion_tokens")
    max_n: int | None = Field(None, ge=1, description="largest n (choices per request)")
    max_tools: int | None = Field(None, ge=0, description="most tools a request may declare")
    max_json_depth: int | None = Field(None, ge=2, description="deepest nesting of the request's JSON")


class GovIdFormat(_Strict):
    """A government-ID format: a regex (RE2 syntax) and the placeholder label (``SSN`` -> ``[SSN]``)."""

    label: str = Field(min_length=1, pattern=r"^[A-Z0-9_]+$", description="the placeholder's label: SSN -> [SSN]")
    pattern: str = Field(min_length=1, description="RE2 regex of the format")


class RuleConfig(_Strict):
    """One rule. ``kind`` picks the detector; the kind-specific fields are listed below it."""

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$", description="shown in refusals and metrics")
    kind: RuleKind = Field(description="the detector")
    action: Action = Field("block", description="block: refuse (400 content_filter); redact: replace; log: count only")
    apply_to: list[Direction] = Field(
        default_factory=lambda: list[Direction](["input"]), min_length=1, description="prompts, completions or both"
    )
    # pattern
    patterns: list[str] = Field(default_factory=list, description="kind=pattern: RE2 regexes")
    # words
    words: list[str] = Field(default_factory=list, description="kind=words: whole words, case-insensitive")
    # phone
    regions: list[str] = Field(default_factory=lambda: ["US"], description="kind=phone: default regions")
    # gov_id
    formats: list[GovIdFormat] = Field(default_factory=list, description="kind=gov_id")
    # injection
    threshold: float = Field(1.0, gt=0, description="kind=injection: block at this score or above")
    families: list[Family] = Field(
        default_factory=lambda: list[Family](["override", "roleplay", "extraction"]),
        description="kind=injection: the heuristics that score",
    )
    placeholder: str | None = Field(None, description="redact: the replacement (default: [KIND])")

    @model_validator(mode="after")
    def _kind_fields(self) -> RuleConfig:
        if self.kind == "pattern" and not self.patterns:
            raise ValueError(f"rule '{self.id}': kind 'pattern' needs 'patterns'")
        if self.kind == "words" and not self.words:
            raise ValueError(f"rule '{self.id}': kind 'words' needs 'words'")
        if self.kind == "gov_id" and not self.formats:
            raise ValueError(f"rule '{self.id}': kind 'gov_id' needs 'formats'")
        return self


class ClassifierConfig(_Strict):
    """A model-based check: the prompt is sent to a guard model served by an OpenAI-compatible worker;
    a reply matching ``unsafe_pattern`` refuses the request (rule id ``rule_id``)."""

    url: str = Field(pattern=r"^https?://", description="base URL of the worker, e.g. http://127.0.0.1:8200")
    model: str = Field(min_length=1, description="the guard model's name on that worker")
    timeout_ms: float = Field(300.0, gt=0, description="time budget of one check")
    on_error: Literal["fail_open", "fail_closed"] = Field(
        "fail_closed", description="a check that fails or runs over: fail_closed refuses (503), fail_open lets it pass"
    )
    unsafe_pattern: str = Field(r"(?i)^\s*unsafe", description="RE2 regex run on the guard model's reply")
    action: Literal["block", "log"] = Field("block", description="block: refuse an unsafe prompt; log: count only")
    rule_id: str = Field("classifier", description="the rule id in refusals, metrics and audit lines")
    max_chars: int = Field(8000, ge=1, description="longer prompts are sent truncated to their last max_chars")


class OutputConfig(_Strict):
    hold_back_chars: int = Field(
        256, ge=1, le=65536, description="stream text held back per choice; matches up to this length are caught"
    )


class ModelOverride(_Strict):
    limits: dict[str, int | None] = Field(default_factory=dict, description="fields of limits to override")
    rules: list[RuleConfig] | None = Field(None, description="replaces the global rules for this model")
    tokenizer: str | None = Field(None, description="path to the model's tokenizer.json")
    enabled: bool = Field(True, description="false: no safety checks for this model")

    @model_validator(mode="after")
    def _known_limits(self) -> ModelOverride:
        unknown = sorted(set(self.limits) - set(LimitsConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown limits: {', '.join(unknown)}")
        LimitsConfig.model_validate(self.limits)
        return self


class SafetyConfig(_Strict):
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="request-shape limits of every model")
    rules: list[RuleConfig] = Field(default_factory=list, description="rules of every model, in order")
    classifier: ClassifierConfig | None = Field(None, description="optional guard-model check")
    output: OutputConfig = Field(default_factory=OutputConfig, description="stream hold-back of output rules")
    tokenizer: str | None = Field(None, description="default tokenizer.json path; '{model}' is the model name")
    models: dict[str, ModelOverride] = Field(default_factory=dict, description="per model name (not alias): overrides")

    @model_validator(mode="after")
    def _unique_ids(self) -> SafetyConfig:
        for where, rules in [("rules", self.rules)] + [
            (f"models.{name}.rules", m.rules or []) for name, m in self.models.items()
        ]:
            ids = [r.id for r in rules]
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            if dupes:
                raise ValueError(f"{where}: rule ids must be unique; repeated: {', '.join(dupes)}")
        if self.limits.max_prompt_tokens is not None and self.tokenizer is None:
            raise ValueError("limits.max_prompt_tokens needs 'tokenizer' (a tokenizer.json path; '{model}' allowed)")
        for name, override in self.models.items():
            if override.limits.get("max_prompt_tokens") is not None and self.tokenizer_for(name) is None:
                raise ValueError(f"models.{name}: max_prompt_tokens needs a 'tokenizer' path")
        return self

    def checks_output(self) -> bool:
        """True when any rule (global or per model) runs on completions: only then is stream text parsed
        and held back."""
        rule_lists = [self.rules, *(m.rules or [] for m in self.models.values())]
        return any("output" in r.apply_to for rules in rule_lists for r in rules)

    def limits_for(self, model: str) -> LimitsConfig:
        override = self.models.get(model)
        if override is None or not override.limits:
            return self.limits
        return self.limits.model_copy(update=override.limits)

    def rules_for(self, model: str) -> list[RuleConfig]:
        override = self.models.get(model)
        return self.rules if override is None or override.rules is None else override.rules

    def tokenizer_for(self, model: str) -> str | None:
        override = self.models.get(model)
        if override is not None and override.tokenizer:
            return override.tokenizer
        return self.tokenizer.replace("{model}", model) if self.tokenizer else None
