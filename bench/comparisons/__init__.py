"""One module per comparison of `make bench`: `measure(bench)` runs it, `rows(result)` writes its table rows."""
