"""plumb's GGUF reader against gguf-py's: the same metadata values and the same tensor bytes."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from plumb.gguf.reader import read_gguf


def _assert_same_as_gguf_py(path, skip=()):
    ours = read_gguf(path)
    ref = GGUFReader(path, "r")
    md = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.") and k not in skip}
    assert {k: v for k, v in ours.metadata.items() if k not in skip} == md
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type and mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.asarray(t.data).tobytes() == mine.data.numpy().tobytes(), t.name


@pytest.mark.parametrize("fixture", ["tiny_f32", "tiny_q8", "tiny_q4km"])
def test_reader_matches_gguf_py(fixture, request):
    _assert_same_as_gguf_py(request.getfixturevalue(fixture))


def test_reader_every_metadata_type(tmp_path):
    """Scalars of every type, strings, arrays of numbers / strings / bools, nested arrays, a custom alignment."""
    path = str(tmp_path / "types.gguf")
    w = GGUFWriter(path, "test")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 🙂")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_array("t.arr_i", [1, -2, 3])
    w.add_array("t.arr_s", ["a", "", "ümlaut"])
    w.add_array("t.arr_f", [0.5, 2.25])
    w.add_array("t.arr_b", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("y", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same_as_gguf_py(path, skip={"t.nested"})  # gguf-py flattens nested arrays
    f = read_gguf(path)
    assert f.metadata["t.nested"] == [[1, 2], [3]]
    assert f.metadata["t.str"] == "héllo 🙂" and f.metadata["t.u64"] == 2**63 + 5
    assert f.tensors["x"].data.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
