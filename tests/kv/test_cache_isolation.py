"""Issue 46, finding 2: several API keys, each a principal, isolated in the cache ([cache] isolation).

Without a model: the key file's parsing, the isolation setting's resolution, the salts (secret file,
roots, the chain a principal walks past shared pins). On real `mlx-kvserve run` processes with
SmolLM2 and the openai SDK: key B gets 0 cached tokens on key A's prompt in RAM and after a restart
while A hits; an admin pin marked shared is hit by both keys; the PIN probe (tests/pinprobe.py)
reads the PIN through a shared cache with exact cached_tokens, and reads nothing per key or with
cached_tokens in whole blocks."""

from __future__ import annotations

import stat

import httpx
import openai
import pytest
from pinprobe import QUESTION, messages, probe_pin, victim_system
from test_server_e2e import write_config

from mlx_kvserve.api_keys import ApiKeys, load_api_keys, parse_key_file
from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.config import load_config
from mlx_kvserve.errors import ConfigError
from mlx_kvserve.kv.salts import SECRET_FILE, CacheSalts, principal_chain, tail_parent

KEY_A, KEY_B, KEY_C, ADMIN = "sk-alice-123", "sk-bob-456", "sk-carol-000", "sk-admin-789"
KEY_FILE = f"# the office's keys\nalice: {KEY_A}\n\n{KEY_B}\ncarol: {KEY_C}\n"
PIN = "4821"
BLOCK = 64

# --- the key file (no server) --------------------------------------------------------------------


def test_key_file_names_keys_and_skips_comments():
    alice, bob, _ = parse_key_file(KEY_FILE, "keys")
    assert (alice.name, alice.key, alice.identity) == ("alice", KEY_A, "alice")
    assert (bob.name, bob.key) == ("key-2", KEY_B)  # unnamed: by its place among the keys
    assert bob.identity.startswith("#") and KEY_B not in bob.identity  # a digest of the key, never the key
    # Reordering unnamed keys never hands one key another's namespace.
    assert parse_key_file(f"x-1\n{KEY_B}\n", "k")[1].identity == bob.identity


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "holds no key"),
        ("# only a comment\n\n", "holds no key"),
        (f"{KEY_A}\n{KEY_A}\n", "line 2: the same key"),
        (f"alice: {KEY_A}\nalice: {KEY_B}\n", "line 2: the name 'alice'"),
        (f"bad name: {KEY_A}\n", "line 1: a name"),
        ("alice: two words\n", "line 1: a key"),
    ],
)
def test_bad_key_files_are_refused_without_echoing_keys(text, why):
    with pytest.raises(ConfigError) as info:
        parse_key_file(text, "keys")
    assert why in info.value.message and info.value.param == "server.api_key_file"
    assert KEY_B not in info.value.message and "two words" not in info.value.message


def test_isolation_resolves_from_the_keys(tmp_path):
    (tmp_path / "keys").write_text(KEY_FILE)
    config = load_config(write_config(tmp_path, f'[server]\napi_key_file = "{tmp_path / "keys"}"\n'))
    keys = load_api_keys(config.server)
    assert keys.inference == KEY_A and [p.name for p in keys.named()] == ["alice", "key-2", "carol"]
    assert keys.isolated("auto") and keys.isolated("per_key") and not keys.isolated("shared")
    assert not keys.whole_blocks("auto", "auto") and keys.whole_blocks("shared", "auto")
    one = ApiKeys(KEY_A, ADMIN)
    assert not one.isolated("auto") and one.isolated("per_key") and not one.whole_blocks("shared", "auto")
    assert [p.name for p in one.named()] == ["key-1"]
    (tmp_path / "one").write_text(KEY_A + "\n")  # one unnamed key reads as it always did
    single = write_config(tmp_path, f'[server]\napi_key_file = "{tmp_path / "one"}"\n')
    assert load_api_keys(load_config(single).server) == ApiKeys(KEY_A, "")
    same = write_config(tmp_path, f'[server]\napi_key_file = "{tmp_path / "keys"}"\nadmin_api_key = "{KEY_B}"\n')
    with pytest.raises(ConfigError, match="admin key must differ"):
        load_api_keys(load_config(same).server)
    with pytest.raises(ConfigError, match="cache.isolation"):
        load_config(write_config(tmp_path, '[cache]\nisolation = "tenant"\n'))


# --- salts (no model) ----------------------------------------------------------------------------


def test_the_secret_is_private_persisted_and_salts_each_principal(tmp_path):
    namespace = b"n" * 32
    salts = CacheSalts(tmp_path, namespace)
    assert not (tmp_path / SECRET_FILE).exists()  # made only when a root is asked for
    root_a, root_b = salts.root("alice"), salts.root("bob")
    assert len({root_a, root_b, namespace}) == 3
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert CacheSalts(tmp_path, namespace).root("alice") == root_a  # a restart: the same roots
    assert CacheSalts(tmp_path, b"m" * 32).root("alice") != root_a  # another model's namespace
    assert CacheSalts(None, namespace).root("alice") != root_a  # no folder: a secret of its own
    (tmp_path / SECRET_FILE).write_bytes(b"short")  # damaged: replaced, the old chains unreachable
    assert CacheSalts(tmp_path, namespace).root("alice") != root_a
    assert tail_parent(b"p" * 32, None) == b"p" * 32 and tail_parent(b"p" * 32, root_a) != tail_parent(
        b"p" * 32, root_b
    )


def test_a_principal_walks_shared_pins_then_its_own_chain():
    hasher = BlockHasher(b"n" * 32, 4)
    tokens = list(range(16))
    plain = hasher.hash_blocks(tokens)
    root = b"r" * 32
    own = hasher.hash_blocks(tokens, root=root)
    assert not set(plain) & set(own)
    assert principal_chain(hasher, tokens, None, lambda h: True) == plain
    assert principal_chain(hasher, tokens, root, lambda h: False) == own
    shared = set(plain[:2])
    assert principal_chain(hasher, tokens, root, shared.__contains__) == plain[:2] + own[2:]
    assert principal_chain(hasher, tokens, root, {plain[1]}.__contains__) == own  # only a leading run counts


# --- real servers on SmolLM2 ---------------------------------------------------------------------


def _keyed_config(folder, cache: str = "") -> tuple[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "keys").write_text(KEY_FILE)
    text = f'[server]\nadmin_api_key = "{ADMIN}"\n[generation]\nmax_tokens = 1\ntemperature = 0.0\n{cache}'
    return "--api-key-file", str(folder / "keys"), write_config(folder, text)


def _start(start, smollm_dir, folder, cache: str = "", home=None):
    flag, keys, config = _keyed_config(folder, cache)
    return start(smollm_dir, flag, keys, config=config, home=home)


def cached(server, key: str, system: str, headers: dict | None = None) -> int:
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120, default_headers=headers
    )
    reply = client.chat.completions.create(model="default", messages=messages(system), max_tokens=1)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_key_b_gets_nothing_of_key_a_in_ram_and_after_a_restart(start_server, smollm_dir, tmp_path):
    """A key's first request is the one that can show 0: its later ones reuse its own tails of the
    chat template's opening tokens. So B is checked in RAM, and C, who sends nothing before, after
    the restart."""
    home = tmp_path / "home"
    server = _start(start_server, smollm_dir, tmp_path / "cfg", home=home)
    prompt_a = victim_system(PIN)
    assert cached(server, KEY_A, prompt_a) == 0
    assert cached(server, KEY_A, prompt_a) >= 2 * BLOCK  # A hits its own prompt
    # B, the same prompt: nothing of A's, also when it names A in the header a model's process trusts.
    assert cached(server, KEY_B, prompt_a, {"x-kvserve-principal": "alice"}) == 0
    assert cached(server, KEY_B, prompt_a) >= 2 * BLOCK  # B's own cache works
    assert cached(server, ADMIN, prompt_a) == 0  # the admin key is a principal of its own
    server.stop()
    log = server.log_path.read_text()  # each request's line names its principal, never its key
    assert "each key caches apart (alice, key-2, carol, admin)" in log
    assert all(f"key={name}" in log for name in ("alice", "key-2", "admin"))
    assert not any(key in log for key in (KEY_A, KEY_B, KEY_C, ADMIN))
    server = _start(start_server, smollm_dir, tmp_path / "cfg", home=home)  # a new process, same cache folder
    assert cached(server, KEY_C, prompt_a) == 0
    assert cached(server, KEY_A, prompt_a) >= 2 * BLOCK  # A's blocks came back from the SSD
    assert cached(server, KEY_B, prompt_a) >= 2 * BLOCK  # and B's own
    stats = httpx.get(server.base_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert stats["ssd_hits"] > 0


def test_a_shared_admin_pin_is_hit_by_every_key(start_server, smollm_dir, tmp_path):
    server = _start(start_server, smollm_dir, tmp_path / "cfg")
    system = victim_system("0000")
    body = {"messages": [{"role": "system", "content": system}], "add_generation_prompt": False, "shared": True}
    pinned = httpx.post(
        server.base_url + "/v1/cache/pin", json=body, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120
    )
    assert pinned.status_code == 200, pinned.text
    tokens = pinned.json()["tokens"]
    assert tokens >= 2 * BLOCK
    assert cached(server, KEY_A, system) >= tokens  # both keys start from the shared blocks
    assert cached(server, KEY_B, system) >= tokens
    # After the shared blocks each key's blocks are its own: B's repeat hits further, A's does not see B's.
    longer = system + " " + QUESTION * 30
    assert cached(server, KEY_B, longer) >= tokens
    assert cached(server, KEY_B, longer) > tokens + BLOCK
    assert cached(server, KEY_A, longer) < tokens + BLOCK
    bad = httpx.post(
        server.base_url + "/v1/cache/pin", json={**body, "shared": "yes"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "shared"
    # The PIN probe per key, on the shared pin's first blocks: C (who sent nothing yet) reads nothing of
    # A's PIN, though A's prompt and C's guesses start from the same shared blocks (tails after them
    # are each key's own).
    assert cached(server, KEY_A, victim_system(PIN)) >= tokens
    result = probe_pin(lambda system: cached(server, KEY_C, system))
    assert result.pin is None and result.requests == 10, result.readings
    assert min(result.readings[0]) >= tokens


@pytest.mark.parametrize(
    ("cache", "readable"),
    [
        ('[cache]\nisolation = "shared"\nreport_cached = "exact"\n', True),  # the finding
        ('[cache]\nisolation = "shared"\n', False),  # shared among several keys: whole blocks by default
    ],
    ids=["shared-exact", "shared-blocks"],
)
def test_the_pin_probe_through_a_shared_cache(start_server, smollm_dir, tmp_path, cache, readable):
    """Per key: in test_a_shared_admin_pin_is_hit_by_every_key. Two digits here (ten requests each)."""
    server = _start(start_server, smollm_dir, tmp_path / "cfg", cache)
    cached(server, KEY_A, victim_system(PIN))  # A's request: its blocks and tails are cached
    result = probe_pin(lambda system: cached(server, KEY_B, system), digits=2)
    if readable:
        assert result.pin == PIN[:2] and result.requests == 20
    else:  # whole blocks: every guess of the first digit reads the same
        assert result.pin is None, result.readings
        assert len(set(result.readings[0])) == 1 and result.readings[0][0] % BLOCK == 0


def test_a_model_in_its_own_process_keeps_the_keys_apart(start_server, tiny_model_dir, tmp_path):
    """The parent names each request's principal to the model's process (x-kvserve-principal, which
    the child trusts only from its parent): the child salts as the parent would."""
    import tinymodel

    other = tinymodel.build_mlx_model(tmp_path / "tiny-b", seed=1, hidden_size=96)
    (tmp_path / "keys").write_text(KEY_FILE)
    config = tmp_path / "models.toml"
    config.write_text(
        f'[server]\napi_key_file = "{tmp_path / "keys"}"\n[cache]\nblock_size = 16\n'
        f'[[models]]\nname = "a"\nsource = "{tiny_model_dir}"\n'
        f'[[models]]\nname = "b"\nsource = "{other}"\nprocess = true\n'
    )
    server = start_server(tiny_model_dir, config=config)
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(4 * 16 + 5)]

    def cached_in_b(key: str, **headers: str) -> int:
        body = {"model": "b", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        headers = {"Authorization": f"Bearer {key}", **headers}
        reply = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_in_b(KEY_A) == 0
    assert cached_in_b(KEY_A) >= 4 * 16
    assert cached_in_b(KEY_B, **{"x-kvserve-principal": "alice"}) == 0  # a client cannot name a principal
    assert cached_in_b(KEY_C) == 0


def test_the_draft_models_block_cache_is_per_principal_too(tiny_model_dir):
    """[speculative] draft: the draft's own prompt blocks are walked from the request's root."""
    from mlx_lm.utils import load

    from mlx_kvserve.engine.speculative.draft import DraftModel, draft_block_cache

    model, _ = load(str(tiny_model_dir))
    draft = DraftModel(model, "draft", draft_block_cache(model, "draft-fp", 16, 1 << 26), prefill_step=64)
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(3 * 16 + 5)]
    root_a, root_b = b"a" * 32, b"b" * 32
    for root, expected in ((root_a, 0), (root_a, len(prompt) - 1), (root_b, 0), (None, 0)):  # blocks and tail
        run = draft.open(prompt, [*prompt, 7], root)
        assert run.cached_tokens == expected, root
        run.close()
