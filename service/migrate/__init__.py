"""``cryptd migrate``: re-encrypt stored ciphertexts from one key to another.

The tool reads tokens from a source (a SQL table, a JSONL or CSV file) in order, sends them
to the service's batch ``rewrap`` with ``to_key`` (the plaintext never reaches the tool),
writes the new tokens back in order and keeps a checkpoint so that a killed run resumes where
it stopped. Layers, each one module:

- :mod:`.model` rows, outcomes, pages and counts: plain data;
- :mod:`.tokens` what a token says about itself (version, key type) without any key;
- :mod:`.source` the interface every source implements; :mod:`.sql` and :mod:`.files` the
  sources (a source knows storage, nothing of keys or HTTP);
- :mod:`.service` the service side: preflight checks of the keys, rewrap, the probe that
  recognises rows already under the target key, verification;
- :mod:`.checkpoint` and :mod:`.failures` the durable state of a run;
- :mod:`.rewrapping` the pipeline: read ahead, rewrap concurrently, commit in order;
- :mod:`.progress` and :mod:`.report` what the operator sees.
"""
