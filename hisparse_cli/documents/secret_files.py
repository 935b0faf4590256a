"""Secrets a folder may hold, which are never fed to the model unless asked for.

`secret_name(rel)` says why a file is a secret by its name alone (checked before it is
opened), `secret_content(text)` why its text is (checked after reading, before it joins the
document). Both return a reason for `Document.skipped` or None. Repositories and collections
apply them to every file (and to a symlink's target); `--include-secrets` turns them off.

By name: environment files (`.env`, `.env.*`, `.envrc`), private keys (`*.pem`, `*.key`,
`*.ppk`, `id_rsa*`, `id_dsa*`, `id_ecdsa*`, `id_ed25519*`), credential files (`.netrc`,
`_netrc`, `.npmrc`, `.pypirc`, `.git-credentials`, `.pgpass`, `.htpasswd`, `.dockercfg`,
AWS's `credentials`, JSON files named for credentials, client secrets or service accounts,
`secrets.{json,yaml,yml,toml,ini}`, Terraform state and variables), keystores (`*.jks`,
`*.keystore`, `*.bks`, `*.p12`, `*.pfx`, `*.kdbx`).
By content: a PEM/OpenSSH/PGP private key block, or a token whose format is unmistakable
(AWS access key id, GitHub, GitLab, Slack, Google API, Stripe live, OpenAI, Anthropic, Hugging
Face, npm and PyPI tokens).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

INCLUDE_HINT = "not read without --include-secrets"

_KEY_SUFFIXES = frozenset({".pem", ".key", ".ppk"})
_KEYSTORE_SUFFIXES = frozenset({".jks", ".keystore", ".bks", ".p12", ".pfx", ".kdbx"})
_KEY_PREFIXES = ("id_rsa", "id_dsa", "id_ecdsa", "id_ed25519")
_CREDENTIAL_NAMES = frozenset({".netrc", "_netrc", ".npmrc", ".pypirc", ".git-credentials",
                               ".pgpass", ".htpasswd", ".dockercfg", ".s3cfg",
                               "application_default_credentials.json"})
_SECRETS_FILES = re.compile(r"^secrets?\.(json|ya?ml|toml|ini)$", re.IGNORECASE)
_CREDENTIAL_JSON = re.compile(r"(credential|client[_-]?secret|service[_-]?account)",
                              re.IGNORECASE)
_TERRAFORM = (".tfstate", ".tfvars", ".tfstate.backup")

_CONTENT = [
    ("a private key", re.compile(
        r"-----BEGIN (?:(?:RSA|DSA|EC|OPENSSH|ENCRYPTED|PGP) )?PRIVATE KEY(?: BLOCK)?-----")),
    ("an AWS access key", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})")),
    ("a GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_\-]{35}\b")),
    ("a Stripe live key", re.compile(r"\b[rs]k_live_[0-9A-Za-z]{20,}")),
    ("an Anthropic API key", re.compile(r"\bsk-ant-[A-Za-z0-9_\-]{20,}")),
    ("an OpenAI API key", re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_\-]{32,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{34,}\b")),
    ("an npm token", re.compile(r"\bnpm_[A-Za-z0-9]{36}\b")),
    ("a PyPI token", re.compile(r"\bpypi-AgEIcHlwaS5vcmc[A-Za-z0-9_\-]{50,}")),
]


def _reason(what: str) -> str:
    return f"secret ({what}): {INCLUDE_HINT}"


def secret_name(rel: str) -> str | None:
    """Why the file at relative path `rel` is a secret by its name, or None."""
    path = PurePosixPath(rel)
    name, lower = path.name, path.name.lower()
    suffix = path.suffix.lower()
    if lower.startswith(".env"):
        return _reason("environment file")
    if suffix in _KEY_SUFFIXES or lower.startswith(_KEY_PREFIXES):
        return _reason("private key file")
    if suffix in _KEYSTORE_SUFFIXES:
        return _reason("keystore")
    if (lower in _CREDENTIAL_NAMES or _SECRETS_FILES.match(name)
            or (suffix == ".json" and _CREDENTIAL_JSON.search(lower))
            or (lower in ("credentials", "config") and path.parent.name == ".aws")):
        return _reason("credentials file")
    if lower.endswith(_TERRAFORM):
        return _reason("Terraform state or variables")
    return None


def secret_content(text: str) -> str | None:
    """Why `text` looks like it holds a secret (a private key, a token), or None."""
    for what, pattern in _CONTENT:
        if pattern.search(text):
            return _reason(f"contains {what}")
    return None


__all__ = ["secret_name", "secret_content", "INCLUDE_HINT"]
