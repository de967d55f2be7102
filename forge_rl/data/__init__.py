"""Prompt sources that map an index to a row: data files read through Hugging Face `datasets`
(`files.FileSource`, configured by `config.DataConfig`), the order that says which row prompt i reads
(`order`), and the row every source hands out, with `rows.export_rows` to write any source to JSONL.

Importing this package imports neither `datasets` nor `pyarrow`: a config that holds a `DataConfig`
stays cheap to import, and the data is opened only where a source is built."""
