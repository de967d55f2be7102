"""The tiny model's cache: a run after the first copies the model it would have built, byte for byte,
without importing transformers, and leaves the caller's random state as a build does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from forge_rl.models.tiny import CACHE_ENV, TinyModelConfig, create_tiny_model, tiny_model_cache_dir

CONFIG = TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)


def _files(model_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(model_dir.iterdir())}


def test_a_cached_model_is_the_built_one_and_copying_it_imports_no_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = create_tiny_model(CONFIG, tmp_path / "first")
    kept = list(tiny_model_cache_dir().iterdir())
    assert len(kept) == 1 and not kept[0].name.startswith(".building-")  # one model, no build left over
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "no-cache-yet"))
    built_again = create_tiny_model(CONFIG, tmp_path / "built-again")
    assert _files(built_again) == _files(first)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_files(first))

    # In a fresh process, as a run's controller: a hit imports neither transformers nor torch.
    copy = tmp_path / "copy"
    probe = (
        "import sys; from pathlib import Path\n"
        "from forge_rl.models.tiny import TinyModelConfig, create_tiny_model\n"
        f"create_tiny_model(TinyModelConfig(**{CONFIG.__dict__!r}), Path({str(copy)!r}))\n"
        "print(sorted({'transformers', 'torch'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, CACHE_ENV: str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "[]"
    assert _files(copy) == _files(first)


def test_another_config_or_alphabet_is_another_model(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    base = _files(create_tiny_model(CONFIG, tmp_path / "base"))
    other_seed = _files(create_tiny_model(TinyModelConfig(**{**CONFIG.__dict__, "seed": 1}), tmp_path / "seed"))
    other_alphabet = _files(create_tiny_model(CONFIG, tmp_path / "alphabet", alphabet="0123456789="))
    assert other_seed["model.safetensors"] != base["model.safetensors"]
    assert other_alphabet["tokenizer.json"] != base["tokenizer.json"]
    assert len(list(tiny_model_cache_dir().iterdir())) == 3


def test_building_leaves_the_callers_random_state_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    create_tiny_model(CONFIG, tmp_path / "built")  # a miss: builds
    assert torch.equal(torch.rand(3), expected)


def test_an_unwritable_cache_still_gives_the_model(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # its tiny-models directory cannot be created
    model_dir = create_tiny_model(CONFIG, tmp_path / "model")
    assert (model_dir / "model.safetensors").is_file()
