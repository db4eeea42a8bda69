"""Settings from files: every ``STAGETREE_*`` setting can also be given as ``<NAME>_FILE=<path>``.

Kubernetes and Docker mount secrets as files (``/run/secrets/admin-token``); a token in a variable shows
in ``docker inspect``, ``kubectl describe`` and ``/proc/<pid>/environ``. ``FileVariablesSource`` is a
pydantic-settings source that reads ``STAGETREE_MASTER_AUTH__ADMIN_TOKEN_FILE`` as if its file's content
(a trailing newline stripped) were ``STAGETREE_MASTER_AUTH__ADMIN_TOKEN``; a dict setting's file holds
JSON (``STAGETREE_MASTER_AUTH__TOKENS_FILE`` -> ``{"alice": "..."}``). Setting both a variable and its
``_FILE`` variant is an error (which one wins would be a guess); a setting whose own name ends in
``_FILE`` (``STAGETREE_MASTER_TLS__CERT_FILE``, a path) is read as itself. ``read_secret_file`` does the same for the
SDK's and CLI's ``STAGETREE_TOKEN_FILE``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource

from stagetree.core.errors import InvalidArgument
from stagetree.envcheck import setting_names

SUFFIX = "_FILE"


def read_secret_file(path: str, variable: str) -> str:
    """The content of a secret file, without its trailing newline; a clear error when unreadable."""
    try:
        return Path(path).expanduser().read_text().rstrip("\r\n")
    except OSError as e:
        raise InvalidArgument(f"{variable}: cannot read the file {path!r} ({e.strerror or e})") from None


class FileVariablesSource(EnvSettingsSource):
    """``<PREFIX><NAME>_FILE`` variables, read as ``<PREFIX><NAME>`` with the file's content."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        prefix = (self.env_prefix or "").lower()
        # a setting whose own name ends in _FILE (tls.cert_file) is a path, not a file variant
        own = {n.lower() for n in setting_names(self.settings_cls, prefix, self.env_nested_delimiter or "__")}
        present = {k.lower() for k, v in os.environ.items() if v}  # an empty variable is an unset one here
        out: dict[str, str | None] = {}
        for key, path in os.environ.items():
            low = key.lower()
            if not (low.startswith(prefix) and low.endswith(SUFFIX.lower())) or not path or low in own:
                continue
            name = low[: -len(SUFFIX)]
            if name in present:
                raise InvalidArgument(f"{key[: -len(SUFFIX)]} and {key} are both set; keep one")
            out[name] = read_secret_file(path, key)
        return out


def with_file_variables(
    settings_cls: type[BaseSettings],
    init_settings: PydanticBaseSettingsSource,
    env_settings: PydanticBaseSettingsSource,
    dotenv_settings: PydanticBaseSettingsSource,
    file_secret_settings: PydanticBaseSettingsSource,
) -> tuple[PydanticBaseSettingsSource, ...]:
    """The sources of a settings class, ``_FILE`` variables right after the plain ones (for
    ``settings_customise_sources``)."""
    return init_settings, env_settings, FileVariablesSource(settings_cls), dotenv_settings, file_secret_settings


def env_or_file(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``$name``, else the content of the file ``$name_FILE`` names, else None."""
    env: Mapping[str, Any] = os.environ if environ is None else environ
    value = env.get(name)
    path = env.get(name + SUFFIX)
    if value and path:
        raise InvalidArgument(f"{name} and {name}{SUFFIX} are both set; keep one")
    if value:
        return str(value)
    return read_secret_file(str(path), name + SUFFIX) if path else None


class FileVariablesSettings(BaseSettings):
    """A settings class whose every setting may also come as ``<NAME>_FILE`` (a secret mount)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return with_file_variables(settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings)
