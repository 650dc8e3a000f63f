#!/usr/bin/env bash
# Build the Debian package with Debian's own dpkg-deb: the release binary,
# then the man pages and shell completions it generates, then the package
# tree laid out from packaging/debian/ (control, maintainer scripts) and the
# asset list below. Prints the .deb's path on its last line.
#
#   packaging/build-deb.sh [--no-build] [--deb-version VERSION]
#
# --no-build packages the binaries already in target/release; --deb-version
# replaces the version (default: Cargo.toml's, revision 1). Nothing here is
# compiled but the project itself: no packaging tool to build first.
set -euo pipefail
cd "$(dirname "$0")/.."

build=1
version=
while [ $# -gt 0 ]; do
    case $1 in
    --no-build) build=0 ;;
    --deb-version) version=$2; shift ;;
    *) echo "usage: $0 [--no-build] [--deb-version VERSION]" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$version" ]; then
    version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)-1
fi
if [ $build -eq 1 ]; then
    cargo build --release >&2
fi
rm -rf target/assets
./target/release/vllm-warden assets target/assets
gzip -9n target/assets/man/*

# SOURCE DESTINATION MODE: what the package installs (a DESTINATION ending
# in / keeps the source's name). Files under etc/ are the package's
# conffiles.
assets=(
    "target/release/vllm-warden usr/bin/ 755"
    "target/release/vllm-warden-sim usr/lib/vllm-warden/ 755"
    "systemd/vllm-warden@.service lib/systemd/system/ 644"
    "packaging/sysusers.conf usr/lib/sysusers.d/vllm-warden.conf 644"
    "examples/kimi-k2.5-nvfp4.toml etc/vllm-warden/kimi.toml.example 644"
    "target/assets/man/vllm-warden.8.gz usr/share/man/man8/ 644"
    "target/assets/man/vllm-warden.toml.5.gz usr/share/man/man5/ 644"
    "target/assets/completions/vllm-warden.bash usr/share/bash-completion/completions/vllm-warden 644"
    "target/assets/completions/_vllm-warden usr/share/zsh/vendor-completions/ 644"
    "target/assets/completions/vllm-warden.fish usr/share/fish/vendor_completions.d/ 644"
    "README.md usr/share/doc/vllm-warden/ 644"
    "packaging/debian/copyright usr/share/doc/vllm-warden/ 644"
    "docs/operator-guide.md usr/share/doc/vllm-warden/docs/ 644"
    "docs/benchmarks.md usr/share/doc/vllm-warden/docs/ 644"
    "docs/architecture.md usr/share/doc/vllm-warden/docs/ 644"
    "examples/vllm-warden-front.socket usr/share/doc/vllm-warden/examples/ 644"
    "packaging/observability/vllm-warden.rules.yml usr/share/vllm-warden/ 644"
    "packaging/observability/vllm-warden.dashboard.json usr/share/vllm-warden/ 644"
    "packaging/container/vllm-warden.prometheusrule.yaml usr/share/vllm-warden/ 644"
)

arch=$(dpkg --print-architecture)
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
chmod 755 "$root"
for a in "${assets[@]}"; do
    read -r src dst mode <<<"$a"
    case $dst in */) dst=$dst$(basename "$src") ;; esac
    install -D -m "$mode" "$src" "$root/$dst"
done

mkdir -p "$root/DEBIAN"
# The shared libraries the binaries link, as Debian names their packages.
shlibs=$(
    cd "$root"
    mkdir -p debian
    : >debian/control
    dpkg-shlibdeps -O usr/bin/vllm-warden usr/lib/vllm-warden/vllm-warden-sim 2>/dev/null |
        sed -n 's/^shlibs:Depends=//p'
    rm -rf debian
)
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE@/$size/" \
    -e "s/@DEPENDS@/${shlibs:+$shlibs, }systemd/" packaging/debian/control.in >"$root/DEBIAN/control"
for s in postinst postrm; do
    install -m 755 "packaging/debian/$s" "$root/DEBIAN/$s"
done
(cd "$root" && find etc -type f | sed 's|^|/|' | sort) >"$root/DEBIAN/conffiles"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
chmod 644 "$root/DEBIAN/control" "$root/DEBIAN/conffiles" "$root/DEBIAN/md5sums"

mkdir -p target/debian
deb=target/debian/vllm-warden_${version}_$arch.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >&2
echo "$PWD/$deb"
