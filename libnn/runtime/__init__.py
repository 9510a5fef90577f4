"""libnn's core: device discovery, arrays, streams, plan caches and the kernel loader."""
