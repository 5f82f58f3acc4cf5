"""lmdq.api.auth: tenant:key pairs, kept as digests; errors name the entry, never the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmdq.api.auth import KeyRing, load_keyring
from lmdq.errors import BadSetting, ExitCode

K1 = "k1-" + "a" * 20
K2 = "k2-" + "b" * 20


def test_keys_from_env_and_file_name_their_tenants(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# comment\n\nteam-b:{K2}\n")
    ring = load_keyring(f" team-a : {K1} ,", f)
    assert len(ring) == 2 and ring.tenants == {"team-a", "team-b"}
    assert ring.tenant_of(K1) == "team-a" and ring.tenant_of(K2) == "team-b"
    assert ring.tenant_of("") is None and ring.tenant_of(K1 + "x") is None and ring.tenant_of(K1[:-1]) is None


def test_the_plain_keys_are_not_kept() -> None:
    ring = KeyRing([("t", K1)])
    assert K1 not in repr(vars(ring))


@pytest.mark.parametrize("keys, where", [
    (f"a:{K1},nocolon", "LMDQ_API_KEYS entry 2"), ("a:", "entry 1"), (f"-bad:{K1}", "tenant"),
    (f"{'x' * 65}:{K1}", "tenant"), ("a:short-secret", "shorter than 16"),
])
def test_bad_entries_are_named_without_their_key(keys: str, where: str) -> None:
    with pytest.raises(BadSetting, match=where) as e:
        load_keyring(keys, None)
    assert K1 not in str(e.value) and "short-secret" not in str(e.value)
    assert e.value.exit_code == ExitCode.bad_input


def test_a_file_error_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"a:{K1}\n\nb:tiny\n")
    with pytest.raises(BadSetting, match=f"{f}:3"):
        load_keyring(None, f)
    f.write_text(f"team-a:{K1}\nno-colon-here\n")
    with pytest.raises(BadSetting, match=r"keys:2: expected tenant:key"):
        load_keyring(None, f)
    with pytest.raises(BadSetting, match="cannot read"):
        load_keyring(None, tmp_path / "absent")


def test_no_keys_and_a_shared_key_are_refused() -> None:
    with pytest.raises(BadSetting, match="no API keys"):
        load_keyring(None, None)
    with pytest.raises(BadSetting, match="no API keys"):
        load_keyring(" , # c", None)
    with pytest.raises(BadSetting, match="same key") as e:
        load_keyring(f"a:{K1},b:{K1}", None)
    assert K1 not in str(e.value)
    assert len(load_keyring(f"a:{K1},a:{K1}", None)) == 1  # a repeated pair is harmless
