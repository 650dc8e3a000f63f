#!/usr/bin/env bash
# Build the Debian package: the release binary, then the man pages and shell
# completions it generates, then cargo-deb. Prints the .deb's path.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo deb --version >/dev/null 2>&1; then
    cargo install --locked cargo-deb >&2
fi
cargo build --release >&2
rm -rf target/assets
./target/release/vllm-warden assets target/assets
gzip -9n target/assets/man/*
cargo deb --no-build --no-strip 2>&1 | tail -n 1
