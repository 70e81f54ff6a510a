"""GGUF -> compress -> GGUF: a file compress reads (`model.gguf_file`) and writes again at the same type keeps every
tensor no stage changed byte for byte, the K-quant output of a Q4_0 file included (llama.cpp's search run on its own
dequantized blocks does not always find them again: the source blocks are kept, export/gguf `_unchanged`)."""

import numpy as np
import pytest
import yaml

from conftest import invoke
from tiny import save_tiny


def _raw(path):
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, np.asarray(t.data).copy()) for t in GGUFReader(path).tensors}


def _convert(tmp_path, name, model, file_type, gguf_file=None):
    doc = {"version": 1, "model": {"path": str(model), "dtype": "float32"}, "stages": [], "eval": {"enabled": False},
           "calibration": {"seqlen": 32},
           "export": {"formats": [{"format": "gguf", "type": file_type}]}}
    if gguf_file:
        doc["model"]["gguf_file"] = gguf_file
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, _, err = invoke("run", path, "--output", tmp_path / name)
    assert rc == 0, err
    return tmp_path / name / "gguf"


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0"])
def test_an_unchanged_file_keeps_its_bytes(file_type, tmp_path):
    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512)
    first = _convert(tmp_path, "a", src, file_type)
    name = f"model-{file_type}.gguf"
    second = _convert(tmp_path, "b", first, file_type, gguf_file=name)
    a, b = _raw(first / name), _raw(second / name)
    assert a.keys() == b.keys()
    types = {t for t, _ in a.values()}
    assert file_type in types and (file_type == "Q8_0" or "Q6_K" in types)  # Q4_0's output is Q6_K
    for n in a:
        assert a[n][0] == b[n][0] and np.array_equal(a[n][1], b[n][1]), n
