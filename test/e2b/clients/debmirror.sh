#!/usr/bin/env bash
# debmirror.sh DIR PACKAGE... makes DIR/debian a tiny Debian archive that
# apt in a sandbox of root/base takes for deb.debian.org: bookworm's own
# signed InRelease, its Packages and Translation-en indexes (uncompressed;
# apt falls back to them by hash after the .xz and .gz it asks for first are
# 404), and the .deb files that installing PACKAGE... into root/base needs
# (what base's dpkg status lacks), at their pool paths. Everything is
# fetched once, with apt-get and a private state dir (the machine's apt
# state is not touched), from the archive root/base was built from; DIR is
# made atomically and kept (DIR/done), so later runs need no network.
# scripts/test-e2b-clients.sh serves it to template builds (Mastra's
# default template runs `apt-get update && apt-get install -y s3fs fuse`).
set -euo pipefail
DIR=$1; shift
[ -f "$DIR/done" ] && exit 0
mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock" # one maker at a time (other trees' runs share the cache)
flock 9
[ -f "$DIR/done" ] && exit 0
BASE=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs/base
[ -f "$BASE/var/lib/dpkg/status" ] || { echo "debmirror: $BASE is not built; run deploy/images/build.sh --no-import" >&2; exit 1; }
read -r _ URI SUITE _ <"$BASE/etc/apt/sources.list"
[ "$SUITE" = bookworm ] || { echo "debmirror: root/base uses suite $SUITE; this mirror knows bookworm" >&2; exit 1; }

TMP=$DIR.tmp
rm -rf "$TMP"
mkdir -p "$TMP"/{etc,lists/partial,cache,archives/partial}
echo "deb $URI $SUITE main" >"$TMP/etc/sources.list"
APT=(apt-get -q -o Dir::Etc::SourceList="$TMP/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o Dir::State::Lists="$TMP/lists" -o Dir::Cache="$TMP/cache" -o Dir::Cache::archives="$TMP/archives"
  -o Dir::State::status="$BASE/var/lib/dpkg/status" -o Acquire::Languages=en -o Acquire::GzipIndexes=false
  -o APT::Install-Recommends=true -o APT::Install-Suggests=false -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
"${APT[@]}" update >"$TMP/apt.log" 2>&1 || { cat "$TMP/apt.log" >&2; exit 1; }

host=${URI#http://}; host=${host%%/*}
prefix=$(printf '%s' "${URI#http://}" | tr / _)_dists_${SUITE}
M=$TMP/mirror/debian
D=$M/dists/$SUITE
mkdir -p "$D"
cp "$TMP/lists/${prefix}_InRelease" "$D/InRelease"
for idx in main/binary-amd64/Packages main/i18n/Translation-en; do
  mkdir -p "$D/$(dirname "$idx")/by-hash/SHA256"
  cp "$TMP/lists/${prefix}_$(echo "$idx" | tr / _)" "$D/$idx"
  ln "$D/$idx" "$D/$(dirname "$idx")/by-hash/SHA256/$(sha256sum "$D/$idx" | cut -c1-64)"
done
# The packages' closure over base, with their pool paths.
"${APT[@]}" install -qq --print-uris "$@" >"$TMP/uris"
[ -s "$TMP/uris" ] || { echo "debmirror: apt-get printed nothing to fetch for $*" >&2; exit 1; }
"${APT[@]}" install -y --download-only "$@" >>"$TMP/apt.log" 2>&1 || { cat "$TMP/apt.log" >&2; exit 1; }
while read -r url file _; do
  url=${url//\'/}
  pool=${url#*://$host/debian/}
  pool=$(printf '%b' "${pool//%/\\x}") # %2b is +, %7e is ~
  mkdir -p "$M/$(dirname "$pool")"
  mv "$TMP/archives/$file" "$M/$pool"
done <"$TMP/uris"
rm -rf "$TMP"/{lists,cache,archives,etc}
printf '%s\n' "$@" >"$TMP/done"
rm -rf "$DIR"
mv "$TMP" "$DIR"
