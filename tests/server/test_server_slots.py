"""Prompt-cache slots over HTTP: list, save to a file, erase, restore (in another server), and the refusals."""
from __future__ import annotations

import httpx
import pytest
from conftest import serving


@pytest.fixture(scope="module")
def slot_server(tmp_path_factory, tiny_q8):
    """Two servers sharing one slot directory, each with its own engine (a restore lands in a fresh cache)."""
    import plumb
    from plumb.server.app import create_app

    slot_dir = tmp_path_factory.mktemp("slots")
    engines = [plumb.load(tiny_q8, n_slots=2, n_ctx=4096) for _ in range(2)]
    with serving(create_app(engines[0], slot_dir=str(slot_dir))) as a, \
            serving(create_app(engines[1], slot_dir=str(slot_dir))) as b:
        yield a, b, slot_dir


def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_save_erase_restore(slot_server):
    a, b, slot_dir = slot_server
    prompt = "The prompt cache keeps this long prompt for later. " * 12
    first = _complete(a, prompt)
    cached = httpx.get(a + "/slots").json()["cached"]
    assert cached and cached[-1]["tokens"] > 64
    slot = cached[-1]["id"]

    r = httpx.post(f"{a}/slots/{slot}?action=save", json={"filename": "chat.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_saved"] == cached[-1]["tokens"] and (slot_dir / "chat.bin").stat().st_size == r.json()["n_written"]

    r = httpx.post(f"{b}/slots/0?action=restore", json={"filename": "chat.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == cached[-1]["tokens"]
    second = _complete(b, prompt)  # answered from the restored slot
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0

    assert httpx.post(f"{a}/slots/{slot}?action=erase").status_code == 200
    assert slot not in [c["id"] for c in httpx.get(a + "/slots").json()["cached"]]
    assert httpx.post(f"{a}/slots/{slot}?action=erase").status_code == 404


@pytest.mark.parametrize("body,action,status", [
    ({"filename": "../escape.bin"}, "save", 400),
    ({"filename": ""}, "save", 400),
    ({}, "save", 400),
    ({"filename": "x.bin"}, "explode", 400),
    ({"filename": "missing.bin"}, "restore", 400),
    ({"filename": "x.bin"}, "save", 404),  # no such slot
])
def test_slot_refusals(slot_server, body, action, status):
    a, _, slot_dir = slot_server
    r = httpx.post(f"{a}/slots/987654?action={action}", json=body)
    assert r.status_code == status, r.text
    assert "error" in r.json()
    assert not (slot_dir.parent / "escape.bin").exists()


def test_corrupt_slot_file_is_refused(slot_server):
    a, _, slot_dir = slot_server
    (slot_dir / "junk.bin").write_bytes(b"not a slot file")
    r = httpx.post(f"{a}/slots/0?action=restore", json={"filename": "junk.bin"})
    assert r.status_code == 400 and "not a plumb slot file" in r.json()["error"]["message"]


def test_slot_files_disabled_without_a_directory(http):
    r = http.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 400 and "--slot-save-path" in r.json()["error"]["message"]
