"""Environment tools: install a patched tree, smoke-test it on the GPU, diagnose the platform."""
