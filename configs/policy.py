"""Who may set what: the trigger policy of a Prefect deployment, and what in a configuration is a credential.

An operator on the worker's shell (`grpo-pipeline run --set ...`) may set anything. A run started through
Prefect (a deployment's form, the API, a schedule, a CI key) may change only the fields its deployment
allows (`deploy.trigger.allow` in the deployment's own configuration) and pick a config file only among the
deployment's own (`deploy.trigger.recipes`). Fields that load code, name a host or URL, read or write a path,
or carry a credential can never be allowed: they come from the deployment's config or the environment.
docs/security.md is the threat model.

Pure functions on strings and pydantic models; nothing here reads a file or a server. The flow asks Prefect who
started the run (flows/trigger.py) and calls `check_trigger` before any work.

    >>> [r.field for r in check_trigger(TriggerPolicy(), "cfg.yaml", [], "cfg.yaml",
    ...                                 ["train.grpo.max_steps=5", "model.trust_remote_code=true"])]
    ['model.trust_remote_code']
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

# What a trigger may change unless its deployment says otherwise: the knobs a person tunes between runs of one
# recipe. Each is a number or a choice among fixed values, so none can reach code, a host, a file or a secret.
DEFAULT_ALLOW: tuple[str, ...] = (
    "train.grpo.max_steps",
    "train.grpo.learning_rate",
    "train.grpo.seed",
    "train.lora.r",
    "train.lora.lora_alpha",
    "train.launcher",
    "plan.budget_usd",
)

CODE = "loads code on the worker or the training node"
HOST = "names a host or URL, where the run sends its data and the credentials it holds"
PATH = "reads or writes a path on the worker or in the store"
CREDENTIAL = "carries a credential"
POLICY = "is the deployment's own setting (this policy among them)"

# Fields by dotted path (a prefix covers what is below it). Model names count as paths or hosts: a local
# directory, or a hub repository that may ship code for trust_remote_code to run.
RISKS: dict[str, str] = {
    "data_dir": PATH,
    "data.source": PATH,
    "data.eval_sources": PATH,
    "data.s3_endpoint_url": HOST,
    "model.base": PATH,
    "model.candidates": PATH,
    "model.trust_remote_code": CODE,
    "plan.gpu_catalog": PATH,
    # a dotted path 'package.module:function' is imported; an entry's args name a verifier's URL and headers, a
    # reward model's id and its trust_remote_code
    "train.rewards": CODE,
    "train.checkpoint_uri": PATH,
    "train.s3_endpoint_url": HOST,
    "train.sky.task_yaml": CODE,  # its setup and run commands run on the node
    "train.distributed.accelerate": PATH,  # names DeepSpeed / FSDP config files
    "hpo.storage": HOST,
    "hpo.trial_task_file": CODE,
    "tracking.mlflow_tracking_uri": HOST,
    "deploy": POLICY,
}
# TRL's GRPOConfig and PEFT's LoraConfig fields (train.grpo.*, train.lora.*) by name, where the name alone
# does not tell (the word rules in `_passthrough_risk` catch hub_*, *_dir, *_path, *token*).
PASSTHROUGH_RISKS: dict[str, str] = {
    "trust_remote_code": CODE,
    "model_init_kwargs": CODE,  # model_init_kwargs may carry trust_remote_code
    "report_to": HOST,
    "trackio_space_id": HOST,
    "project": HOST,
    "vllm_server_base_url": HOST,
    "vllm_server_host": HOST,
    "vllm_server_port": HOST,
    "vllm_group_port": HOST,
    "deepspeed": PATH,
    "fsdp_config": PATH,
    "accelerator_config": PATH,
    "resume_from_checkpoint": PATH,
    "output_dir": PATH,
    "runtime_config": PATH,
}
# Words of a key that make its string value a credential: hub_token, api_key, Authorization, X-Api-Key, ...
CREDENTIAL_WORDS = {
    "token",
    "secret",
    "password",
    "passwd",
    "authorization",
    "apikey",
    "credential",
    "credentials",
    "cookie",
    "bearer",
}
CREDENTIAL_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("auth", "token")}
# A subtree whose key ends so holds environment variable *names* (headers_from_env: {Authorization: VERIFIER_TOKEN})
ENV_NAME_SUFFIXES = ("_from_env", "_env")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Library fields whose names hold a credential word but whose values are no secret (PEFT's token indices)
NOT_CREDENTIALS = {"trainable_token_indices"}


def key_words(key: str) -> list[str]:
    """A key's words, lower case: split at '_', '-', '.', spaces and camelCase.

    >>> key_words("X-Api-Key"), key_words("hub_token"), key_words("apiKey")
    (['x', 'api', 'key'], ['hub', 'token'], ['api', 'key'])
    """
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)
    return [w.lower() for w in re.split(r"[\s_\-.]+", spaced) if w]


def credential_key(key: str) -> bool:
    """Whether a key names a credential (its string value is then a secret).

    >>> credential_key("hub_token"), credential_key("Authorization"), credential_key("max_prompt_tokens")
    (True, True, False)
    """
    if key in NOT_CREDENTIALS:
        return False
    words = key_words(key)
    return bool(CREDENTIAL_WORDS & set(words)) or any(
        pair in CREDENTIAL_PAIRS for pair in zip(words, words[1:], strict=False)
    )


# Shapes of secrets whatever key holds them: an Authorization header's value, and the token formats of the
# services a run talks to (Hugging Face, OpenAI-style keys, GitHub, GitLab, AWS access key ids, Slack).
SECRET_SHAPES: tuple[tuple[re.Pattern[str], str], ...] = (
    # the whole value, so a prompt that merely starts with 'Token' or 'Bot' is no header
    (re.compile(r"^\s*(bearer|basic|token|bot)\s+[A-Za-z0-9._~+/=\-]{8,}\s*$", re.I), "an Authorization header value"),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), "a Hugging Face token"),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{32,}"), "an API key (sk-...)"),
    (re.compile(r"\b(ghp|gho|ghs|ghu|github_pat)_[A-Za-z0-9_]{20,}"), "a GitHub token"),
    (re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"), "a GitLab token"),
    (re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"), "an AWS access key id"),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"), "a Slack token"),
    # user:password@host without a scheme (url_secret reads URLs with one)
    (re.compile(r"^[^\s/@:]+:[^\s/@]+@[^\s/@]+"), "a password (user:password@host)"),
)


def url_secret(value: str) -> str | None:
    """What in a URL is a credential (a password, or a token-like query parameter), or None.

    >>> url_secret("https://bob:hunter2@mlflow.example.com"), url_secret("s3://bucket/prefix")
    ('a password', None)
    >>> url_secret("https://x.example.com/data.parquet?X-Amz-Signature=abc")
    "the query parameter 'X-Amz-Signature'"
    """
    if "://" not in value:
        return None
    try:
        parts = urlsplit(value)
        password = parts.password
    except ValueError:
        return None
    if password:
        return "a password"
    for key, _ in parse_qsl(parts.query):
        if any(
            word in key.lower()
            for word in ("token", "secret", "password", "signature", "credential", "apikey", "api_key")
        ):
            return f"the query parameter '{key}'"
    return None


def secret_shape(value: str) -> str | None:
    """What a string looks like when it is a credential (a URL's password or token-like query parameter, or a
    shape in SECRET_SHAPES), or None.

    >>> secret_shape("Bearer abcdef0123456789"), secret_shape("bob:hunter2@db.example.com:5432/grpo")
    ('an Authorization header value', 'a password (user:password@host)')
    >>> secret_shape("configs/demo-cpu.yaml"), secret_shape("package.module:function")
    (None, None)
    """
    if in_url := url_secret(value):
        return in_url
    for pattern, what in SECRET_SHAPES:
        if pattern.search(value):
            return what
    return None


def _passthrough_risk(name: str) -> str | None:
    words = set(key_words(name))
    if credential_key(name):
        return CREDENTIAL
    if name in PASSTHROUGH_RISKS:
        return PASSTHROUGH_RISKS[name]
    if "hub" in words:  # push_to_hub, hub_model_id, log_completions_hub_repo: uploads to a hub repository
        return HOST
    if words & {"dir", "path", "file", "url", "uri", "host"}:
        return PATH if words & {"dir", "path", "file"} else HOST
    return None


def risk(field: str) -> str | None:
    """Why a trigger may never set `field` (a dotted path), or None when a deployment may allow it.

    >>> risk("train.grpo.push_to_hub"), risk("train.grpo.hub_token"), risk("train.rewards")
    ('names a host or URL, where the run sends its data and the credentials it holds', 'carries a credential', 'loads code on the worker or the training node')
    >>> risk("train.grpo.learning_rate") is None, risk("train") == risk("train.rewards")
    (True, True)
    """
    parts = field.split(".")
    if parts[-1] == "trust_remote_code":
        return CODE
    if credential_key(parts[-1]):
        return CREDENTIAL
    for known, why in RISKS.items():
        if field == known or field.startswith(known + "."):
            return why
    if len(parts) > 2 and parts[:2] in (["train", "grpo"], ["train", "lora"]):
        return _passthrough_risk(parts[2])
    # a whole section (`model={...}`, `train.grpo={...}`) holds the risky fields below it
    below = [why for known, why in RISKS.items() if known.startswith(field + ".")]
    if below:
        return below[0]
    if parts in (["train", "grpo"], ["train", "lora"]):
        return CODE if parts[1] == "grpo" else PATH  # model_init_kwargs / runtime_config among their fields
    return None


class TriggerPolicy(BaseModel):
    """What a run started through Prefect (form, API, schedule, CI key) may set. Fixed at deploy time: it is read
    from the deployment's own configuration (its config_path and deploy-time overrides as the server holds them),
    never from the run's parameters. An operator on the worker's shell is not bound by it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ALLOW),
        description="dotted fields a trigger may set through `overrides` (and `launcher` -> train.launcher, "
        "`budget_usd` -> plan.budget_usd); exact names, no wildcards. Fields that load code, name a host or URL, "
        "read or write a path, or carry a credential cannot be listed",
    )
    recipes: list[str] = Field(
        default_factory=list,
        description="config files a trigger may pick as `config_path` besides the deployment's own, as the worker "
        "resolves them (relative to the folder its runs work in, where `grpo-pipeline deploy` ran, e.g. "
        "configs/gsm8k-calc-cpu.yaml; or absolute)",
    )

    @field_validator("allow")
    @classmethod
    def _never_risky(cls, v: list[str]) -> list[str]:
        for field in v:
            if why := risk(field):
                raise ValueError(
                    f"'{field}' {why}, so a trigger may never set it; set its value in the deployment's "
                    "config (or `grpo-pipeline deploy --set`) instead of allowing it"
                )
        return v


class Refusal(BaseModel):
    """One thing a trigger asked for and may not have: the field, why, and how to allow it."""

    model_config = ConfigDict(frozen=True)

    field: str
    why: str
    fix: str

    def line(self) -> str:
        return f"{self.field}: {self.why}; {self.fix}"


def override_field(assignment: str) -> str | None:
    """The dotted field an override `a.b.c=value` sets, as `grpo_pipeline.configs.schema.apply_override` reads it; None when it
    is no assignment.

    >>> override_field(" train.lora.r =8"), override_field("no-equals-sign")
    ('train.lora.r', None)
    """
    field, sep, _ = assignment.partition("=")
    return field.strip() if sep and field.strip() else None


def _same_file(a: str | None, b: str | None, root: Path) -> bool:
    if a is None or b is None:
        return a is None and b is None
    # resolved: 'configs/../configs/x.yaml' or a symlink is the file it names, and nothing else is
    return (root / a).resolve() == (root / b).resolve()


def check_trigger(
    policy: TriggerPolicy,
    own_config: str | None,
    own_overrides: typing.Sequence[str],
    config_path: str | None,
    overrides: typing.Sequence[str],
    root: Path = Path("."),
    config_file: str = "the deployment's config",
) -> list[Refusal]:
    """What a triggered run asks for beyond its deployment's policy; empty when the run may go.

    `own_config` and `own_overrides` are the deployment's own (as registered: what `grpo-pipeline deploy` set),
    and pass as they are; `config_path` and `overrides` are the run's. Values are never read or shown: a
    refusal names the field, so a secret typed into the form does not reach the run's log.
    """
    refused = []
    if not (_same_file(config_path, own_config, root) or any(_same_file(config_path, r, root) for r in policy.recipes)):
        refused.append(
            Refusal(
                field="config_path",
                why=f"this deployment runs {own_config or 'the built-in defaults'}"
                f"{' or one of ' + ', '.join(policy.recipes) if policy.recipes else ''}, and a trigger may pick only "
                "among those (a config file decides code, hosts, paths and credentials)",
                fix=f"to allow another recipe, change the deployment: add it to deploy.trigger.recipes in {config_file} "
                "and run `grpo-pipeline deploy` again; or run it on the worker's shell: grpo-pipeline run --config FILE",
            )
        )
    own = set(own_overrides)
    for i, assignment in enumerate(overrides):
        if assignment in own:  # set at deploy time
            continue
        field = override_field(assignment)
        if field is None:
            refused.append(
                Refusal(
                    field=f"overrides[{i}]",
                    why="is not a KEY=VALUE assignment",
                    fix="write it as e.g. train.grpo.max_steps=20",
                )
            )
        elif field in policy.allow:
            continue
        elif why := risk(field):
            refused.append(
                Refusal(
                    field=field,
                    why=f"{why}, so a trigger may never set it",
                    fix=f"change the deployment instead: set it in {config_file} (or `grpo-pipeline deploy --set "
                    f"{field}=...`) and deploy again; or run on the worker's shell: grpo-pipeline run --set {field}=...",
                )
            )
        else:
            refused.append(
                Refusal(
                    field=field,
                    why="is not among the fields this deployment lets a trigger set "
                    f"({', '.join(policy.allow) or 'none'})",
                    fix=f"to allow it, change the deployment: add it to deploy.trigger.allow in {config_file} and run "
                    "`grpo-pipeline deploy` again",
                )
            )
    return refused


def refusal_message(refusals: typing.Sequence[Refusal], deployment: str) -> str:
    """One message for every refusal, the way the CLI and the flow run's state show it.

    >>> print(refusal_message([Refusal(field="model.base", why="w", fix="f")], "grpo-pipeline/manual"))
    refused: a run triggered through the deployment grpo-pipeline/manual may not set (nothing was run):
      model.base: w; f
    """
    return (
        f"refused: a run triggered through the deployment {deployment} may not set (nothing was run):\n  "
        + "\n  ".join(r.line() for r in refusals)
    )
