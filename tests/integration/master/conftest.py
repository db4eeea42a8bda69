"""The master suite uses the shared integration fixtures (tests/integration/conftest.py)."""

from tests.integration.conftest import ADMIN_TOKEN, REDIS_URL, TOKENS, master_settings

__all__ = ["ADMIN_TOKEN", "REDIS_URL", "TOKENS", "master_settings"]
