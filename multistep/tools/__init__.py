"""The command line (``cli``) and what it runs: the toy problem (``blobs``) and the
benchmark harness (``bench``, ``bench_distributed``)."""
