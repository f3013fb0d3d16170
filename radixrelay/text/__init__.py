"""Text on the way in and out: tokenizers (``tokenizer``, with the chunked ``encode_cache``), chat
templates, incremental detokenization and stop strings (``detokenizer``), and the assembly of a
request's output text (``output_text``). Used by every process that needs them (server, engine,
scheduler, worker, lang)."""
