"""An encoded batch handed to datasets as an Arrow table: the same rows and column types as its Python lists."""

import datasets
import numpy as np
import pyarrow as pa
import pytest

from tuneforge.data import arrow_batch
from tuneforge.data.encode import row_features, supervised_features

BATCH = {
    "input_ids": [[1, 2, 3], [], [49151, 0]],
    "labels": [[-100, 2, 3], [], [-100, 0]],
    "attention_mask": [[1, 1, 1], [], [1, 1]],
    "_status": ["ok", "bad", "ok_truncated"],
}


def test_columns_keep_their_values_and_take_the_features_types():
    table = arrow_batch.to_table(BATCH, supervised_features())
    assert table.to_pydict() == BATCH
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("labels").type == pa.list_(pa.int32())
    assert table.schema.field("attention_mask").type == pa.list_(pa.int8())
    assert table.schema.field("_status").type == pa.string()


def test_a_map_writes_the_same_dataset_as_from_python_lists():
    source = datasets.Dataset.from_dict({"n": [3, 0, 2, 5]})

    def encoder(batch, indices, *, offset):
        ids = [list(range(offset + i, offset + i + n)) for i, n in zip(indices, batch["n"], strict=True)]
        return {"input_ids": ids, "labels": [[-100, *row[1:]] for row in ids],
                "attention_mask": [[1] * len(row) for row in ids], "position_ids": [list(range(len(row))) for row in ids]}

    features = row_features(packed=True)
    common = dict(batched=True, batch_size=3, with_indices=True, remove_columns=["n"], features=features)
    plain = source.map(encoder, fn_kwargs={"offset": 7}, **common)
    arrow = source.map(arrow_batch.mapped, fn_kwargs={"encoder": encoder, "features": features, "offset": 7}, **common)
    assert arrow.features == plain.features == features
    assert arrow.data.table.equals(plain.data.table)
    assert arrow[3]["input_ids"] == [10, 11, 12, 13, 14]


def test_a_value_out_of_its_columns_range_raises_instead_of_wrapping():
    with pytest.raises(OverflowError):
        arrow_batch.to_table({**BATCH, "input_ids": [[1], [], [2**31]]}, supervised_features())
    with pytest.raises(OverflowError):
        arrow_batch.to_table({**BATCH, "attention_mask": [[1], [], [300]]}, supervised_features())


def test_a_missing_row_stays_null():
    table = arrow_batch.to_table({"input_ids": [[1], None]}, datasets.Features({"input_ids": row_features(False)["input_ids"]}))
    assert table.column("input_ids").to_pylist() == [[1], None]


def test_rows_given_as_numpy_arrays_convert_too():
    batch = {**BATCH, "input_ids": [np.array(row, dtype=np.int64) for row in BATCH["input_ids"]]}
    assert arrow_batch.to_table(batch, supervised_features()).to_pydict() == BATCH
