"""One module per vendor library: how to build, cache and run that library's plans."""
