"""Files in and out: prompt and request files, the tokenizer, score lines, the resumable
journal and the run identity, shards and merge, per-rank stats tables and traces.

Imports: base, lifecycle, model, engine."""
