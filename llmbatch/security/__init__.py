"""Security for every llm-batch process: how it connects to Temporal (TLS, mutual
TLS, API keys) and how it encrypts what it puts in Temporal (the payload codec and
the codec server that lets operators who hold a key read it).

- ``connection``: the client's connection options from Temporal's environment
  configuration and llm-batch's settings, and one-line connection errors.
- ``codec``: the AES-256-GCM payload codec and its keyring (keys by id, rotation).
- ``codec_server``: Temporal's remote codec protocol over HTTP.
"""
