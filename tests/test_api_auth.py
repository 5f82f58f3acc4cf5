"""lmdq-api's keys: parsed from LMDQ_API_KEYS / LMDQ_API_KEYS_FILE, kept hashed, never echoed."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmdq.api.auth import load_keyring
from lmdq.errors import BadSetting
from tests.conftest import run_cli

K1, K2 = "k1-" + "a" * 30, "k2-" + "b" * 30


def test_env_and_file_keys_name_their_tenants(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# operators' keys\nteam-b:{K2}\n\n")
    ring = load_keyring(f"team-a:{K1}", f)
    assert ring.tenant_of(K1) == "team-a" and ring.tenant_of(K2) == "team-b"
    assert ring.tenant_of(K1 + "x") is None and ring.tenant_of("") is None
    assert ring.tenants == {"team-a", "team-b"}
    assert K1 not in repr(vars(ring)) and K2 not in repr(vars(ring))  # only digests are kept


@pytest.mark.parametrize("keys, says", [
    ("team-a", "entry 1: expected tenant:key"),
    (f"team-a:{K1},bad tenant:{K2}", "entry 2: tenant: expected"),
    ("team-a:t1ny-k3y", "shorter than 16 characters"),
    (f"team-a:{K1},team-b:{K1}", "same key"),
    ("", "no API keys"),
])
def test_bad_keys_are_one_clear_error_without_the_key(keys: str, says: str) -> None:
    with pytest.raises(BadSetting) as e:
        load_keyring(keys or None, None)
    assert says in str(e.value)
    for secret in (K1, K2, "t1ny-k3y"):
        assert secret not in str(e.value)


def test_lmdq_api_without_keys_refuses_to_start(env: dict[str, str]) -> None:
    e = {k: v for k, v in env.items() if not k.startswith("LMDQ_API_KEYS")}
    p = run_cli("lmdq.api", "--port", "0", env=e, timeout=60)
    assert p.returncode == 2, p.stderr.decode()
    err = p.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "no API keys" in err[0]
