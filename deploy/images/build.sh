#!/usr/bin/env bash
# Builds OpenDsec's offline base images from Debian's packages and imports
# them into an image store:
#   root/busybox   Debian's busybox-static in an otherwise empty root
#   root/py:3.11   Debian 12 (bookworm) minbase + python3 (3.11),
#                  ca-certificates, procps
#   root/py-sci:3.11  root/py:3.11 + Debian's python3-pip, python3-numpy and
#                  python3-pil; pip is not marked externally managed
#   root/base      root/py:3.11 + python-is-python3, pip, nodejs, npm, git,
#                  curl, wget, sudo (passwordless for user), iproute2,
#                  netcat-openbsd: E2B's "base" template
#   root/code-interpreter  root/base + Debian's python3-numpy, -pandas,
#                  -matplotlib, -pil: E2B's "code-interpreter-v1" template
# All have a user "user" (uid 1000, home /home/user), as E2B images do.
#
# Root filesystems are cached under ${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
# and rebuilt only when missing or when their version below changes. Safe to
# run twice, and concurrently (a lock serializes runs). Runs as root.
#
# Usage: build.sh [--data-dir DIR] [--only IMAGE] [--no-import]
#                 [--mirror URL] [--opendsec PATH]
#   IMAGE: busybox, py, py-sci, base or code-interpreter
set -euo pipefail

# BUILD_VERSION: bump when the recipe of busybox, py or py-sci changes so
# their caches are rebuilt; BASE_VERSION likewise for base and
# code-interpreter (built on py-3.11, so a BUILD_VERSION bump rebuilds
# them too).
BUILD_VERSION=2
BASE_VERSION=1

usage() {
	sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
}

DATA_DIR=/var/lib/opendsec
ONLY=""
DO_IMPORT=1
MIRROR="${OPENDSEC_MIRROR:-}"
OPENDSEC_BIN="${OPENDSEC_BIN:-}"
SUITE=bookworm

while [ $# -gt 0 ]; do
	case "$1" in
	--data-dir) DATA_DIR="${2:?--data-dir needs a directory}"; shift 2 ;;
	--data-dir=*) DATA_DIR="${1#*=}"; shift ;;
	--only) ONLY="${2:?--only needs busybox, py, py-sci, base or code-interpreter}"; shift 2 ;;
	--only=*) ONLY="${1#*=}"; shift ;;
	--no-import) DO_IMPORT=0; shift ;;
	--mirror) MIRROR="${2:?--mirror needs a URL}"; shift 2 ;;
	--mirror=*) MIRROR="${1#*=}"; shift ;;
	--opendsec) OPENDSEC_BIN="${2:?--opendsec needs a path}"; shift 2 ;;
	--opendsec=*) OPENDSEC_BIN="${1#*=}"; shift ;;
	-h|--help) usage; exit 0 ;;
	*) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done

case "$ONLY" in
""|busybox|py|py-sci|base|code-interpreter) ;;
*) echo "build.sh: --only must be busybox, py, py-sci, base or code-interpreter, not '$ONLY'" >&2; exit 2 ;;
esac

if [ "$(id -u)" -ne 0 ]; then
	echo "build.sh: must run as root (debootstrap and chroot need it)" >&2
	exit 1
fi

case "$DATA_DIR" in /*) ;; *) DATA_DIR="$(pwd)/$DATA_DIR" ;; esac
CACHE_ROOT="${OPENDSEC_CACHE:-/var/cache/opendsec}"
CACHE="$CACHE_ROOT/rootfs"
REPO_DIR="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$CACHE"

log() { printf '[build.sh %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# One run at a time per cache.
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
	log "another build.sh holds $CACHE/.lock; waiting"
	flock 9
fi

# cleanup_dir removes a half-built root safely: first every mount under it
# (debootstrap bind-mounts /proc, /sys and sometimes /dev), then the files,
# never crossing into another filesystem.
cleanup_dir() {
	local d="$1"
	[ -e "$d" ] || return 0
	local m
	# Deepest mounts first.
	while read -r m; do
		if [ -n "$m" ]; then umount -l "$m" 2>/dev/null || true; fi
	done < <(awk -v p="$d" '$2 == p || index($2, p "/") == 1 {print $2}' /proc/mounts | sort -r)
	rm -rf --one-file-system "$d"
}

# apt_install installs Debian packages, refreshing the indexes once if the
# first try fails (fresh machines often have none).
apt_install() {
	export DEBIAN_FRONTEND=noninteractive
	apt-get install -y --no-install-recommends "$@" ||
		{ apt-get update && apt-get install -y --no-install-recommends "$@"; }
}

stamp_ok() { # name [version]
	[ -d "$CACHE/$1" ] && [ -f "$CACHE/$1.stamp" ] &&
		[ "$(cat "$CACHE/$1.stamp")" = "version=${2:-$BUILD_VERSION}" ]
}

write_stamp() { # name [version]
	printf 'version=%s\n' "${2:-$BUILD_VERSION}" >"$CACHE/$1.stamp.tmp"
	mv -f "$CACHE/$1.stamp.tmp" "$CACHE/$1.stamp"
}

# publish moves a finished build into place. The old copy (if any) is removed
# only after the new one is in place.
publish() { # name tmpdir [version]
	local name="$1" tmp="$2"
	rm -f "$CACHE/$name.stamp"
	if [ -e "$CACHE/$name" ]; then
		mv "$CACHE/$name" "$CACHE/$name.old.$$"
	fi
	mv "$tmp" "$CACHE/$name"
	cleanup_dir "$CACHE/$name.old.$$"
	write_stamp "$name" "${3:-}"
}

# detect_mirror prints the Debian archive URI for $SUITE from apt's sources
# (one-line sources.list or deb822 .sources), else deb.debian.org.
detect_mirror() {
	local uri=""
	if [ -f /etc/apt/sources.list ]; then
		uri="$(awk -v s="$SUITE" '$1 == "deb" {
			i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
			if ($(i+1) == s) { print $i; exit } }' /etc/apt/sources.list)"
	fi
	if [ -z "$uri" ]; then
		local f
		for f in /etc/apt/sources.list.d/*.sources; do
			[ -f "$f" ] || continue
			uri="$(awk -v s="$SUITE" '
				function flush() { if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " s " ") && uris != "") { split(uris, u, " "); print u[1]; found = 1; exit } types = ""; suites = ""; uris = "" }
				/^[ \t]*$/ { flush(); next }
				/^#/ { next }
				tolower($1) == "types:" { $1 = ""; types = $0 }
				tolower($1) == "suites:" { $1 = ""; suites = $0 }
				tolower($1) == "uris:" { $1 = ""; uris = $0 }
				END { if (!found) flush() }' "$f")"
			[ -n "$uri" ] && break
		done
	fi
	if [ -z "$uri" ]; then
		local f
		for f in /etc/apt/sources.list.d/*.list; do
			[ -f "$f" ] || continue
			uri="$(awk -v s="$SUITE" '$1 == "deb" {
				i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
				if ($(i+1) == s) { print $i; exit } }' "$f")"
			[ -n "$uri" ] && break
		done
	fi
	echo "${uri:-http://deb.debian.org/debian}"
}

# add_user writes user "user" (uid/gid 1000) to a root with plain files, for
# roots without shadow's tools (busybox).
add_user_files() { # root shell
	local r="$1" sh="$2"
	grep -q '^user:' "$r/etc/passwd" 2>/dev/null ||
		echo "user:x:1000:1000:user:/home/user:$sh" >>"$r/etc/passwd"
	grep -q '^user:' "$r/etc/group" 2>/dev/null ||
		echo "user:x:1000:" >>"$r/etc/group"
	mkdir -p "$r/home/user"
	chown 1000:1000 "$r/home/user"
	chmod 0750 "$r/home/user"
}

build_busybox() {
	if stamp_ok busybox; then
		log "busybox: cached at $CACHE/busybox (version $BUILD_VERSION)"
		return 0
	fi
	log "busybox: building"
	if [ "$(dpkg-query -W -f='${Status}' busybox-static 2>/dev/null || true)" != "install ok installed" ]; then
		log "busybox: installing Debian's busybox-static with apt-get"
		apt_install busybox-static
	fi
	local bin
	bin="$(dpkg -L busybox-static | grep -E '/bin/busybox$' | head -n1)"
	[ -x "$bin" ] || { echo "build.sh: busybox-static installed but no busybox binary found" >&2; exit 1; }

	local tmp="$CACHE/busybox.tmp"
	cleanup_dir "$tmp"
	mkdir -p "$tmp"
	local d
	for d in bin sbin usr/bin usr/sbin etc root home tmp proc sys dev var/tmp run; do
		mkdir -p "$tmp/$d"
	done
	chmod 1777 "$tmp/tmp" "$tmp/var/tmp"
	chmod 0700 "$tmp/root"
	install -m 0755 "$bin" "$tmp/bin/busybox"
	local n=0 app
	while read -r app; do
		[ -n "$app" ] || continue
		[ "$app" = "bin/busybox" ] && continue
		[ -e "$tmp/$app" ] || [ -L "$tmp/$app" ] && continue
		mkdir -p "$tmp/$(dirname "$app")"
		ln -s /bin/busybox "$tmp/$app"
		n=$((n + 1))
	done < <("$tmp/bin/busybox" --list-full)
	log "busybox: linked $n applets"
	cat >"$tmp/etc/passwd" <<'PW'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
PW
	cat >"$tmp/etc/group" <<'GR'
root:x:0:
nogroup:x:65534:
GR
	add_user_files "$tmp" /bin/sh
	echo "127.0.0.1 localhost" >"$tmp/etc/hosts"
	: >"$tmp/etc/resolv.conf"
	publish busybox "$tmp"
	log "busybox: done, $(du -sh "$CACHE/busybox" | cut -f1) at $CACHE/busybox"
}

build_py() {
	if stamp_ok py-3.11; then
		log "py-3.11: cached at $CACHE/py-3.11 (version $BUILD_VERSION)"
		return 0
	fi
	command -v debootstrap >/dev/null || {
		log "py-3.11: installing debootstrap with apt-get"
		apt_install debootstrap
	}
	[ -n "$MIRROR" ] || MIRROR="$(detect_mirror)"
	local tmp="$CACHE/py-3.11.tmp"
	cleanup_dir "$tmp"
	mkdir -p "$tmp"
	local start=$SECONDS
	log "py-3.11: debootstrap --variant=minbase $SUITE from $MIRROR (takes a few minutes)"
	if ! debootstrap --variant=minbase --include=python3,ca-certificates,procps \
		"$SUITE" "$tmp" "$MIRROR" 2>&1 | while IFS= read -r line; do
		case "$line" in I:\ Retrieving* | I:\ Validating*) ;; *) log "debootstrap: $line" ;; esac
	done; then
		cleanup_dir "$tmp"
		echo "build.sh: debootstrap failed (mirror $MIRROR; pass --mirror URL to use another)" >&2
		exit 1
	fi
	log "py-3.11: debootstrap done in $((SECONDS - start))s"

	# debootstrap may leave /proc or /sys mounted; nothing must stay mounted.
	local m
	while read -r m; do umount -l "$m" 2>/dev/null || true; done < <(
		awk -v p="$tmp" 'index($2, p "/") == 1 {print $2}' /proc/mounts | sort -r)

	if ! grep -q '^user:' "$tmp/etc/passwd"; then
		chroot "$tmp" /usr/sbin/groupadd -g 1000 user
		chroot "$tmp" /usr/sbin/useradd -m -u 1000 -g 1000 -s /bin/bash -d /home/user user
	fi
	# Keep the image small: package caches, indexes, docs, man pages.
	chroot "$tmp" /usr/bin/apt-get clean
	rm -rf "$tmp"/var/lib/apt/lists/* "$tmp"/var/cache/apt/*.bin \
		"$tmp"/var/cache/debconf/*-old "$tmp"/var/log/*.log "$tmp"/var/log/apt/* \
		"$tmp"/usr/share/doc/* "$tmp"/usr/share/man/* "$tmp"/usr/share/info/* \
		"$tmp"/debootstrap
	# Translations (34 MB); locale.alias stays.
	find "$tmp/usr/share/locale" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
	: >"$tmp/etc/resolv.conf"
	echo "opendsec" >"$tmp/etc/hostname"

	local got
	got="$(chroot "$tmp" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
	[ "$got" = "3.11" ] || { echo "build.sh: expected python 3.11 in the image, got $got" >&2; exit 1; }
	publish py-3.11 "$tmp"
	log "py-3.11: done in $((SECONDS - start))s, $(du -sh "$CACHE/py-3.11" | cut -f1) at $CACHE/py-3.11 (python $got)"
}

# chroot_apt_install installs Debian packages into the root at $1 with
# apt-get in a chroot (from $MIRROR), then removes apt's caches and indexes,
# docs and man pages. On failure it removes the root and exits.
chroot_apt_install() { # root label packages...
	local tmp="$1" label="$2"
	shift 2
	log "$label: apt-get install $* from $MIRROR"
	echo "deb $MIRROR $SUITE main" >"$tmp/etc/apt/sources.list"
	cp /etc/resolv.conf "$tmp/etc/resolv.conf"
	if ! { chroot "$tmp" /usr/bin/apt-get -q update &&
		DEBIAN_FRONTEND=noninteractive chroot "$tmp" /usr/bin/apt-get -q install -y --no-install-recommends "$@"; } 2>&1 | while IFS= read -r line; do
		case "$line" in Get:* | Hit:* | Selecting* | Preparing* | Unpacking* | Setting\ up*) ;; *) log "apt: $line" ;; esac
	done; then
		cleanup_dir "$tmp"
		echo "build.sh: apt-get in the $label root failed (mirror $MIRROR; pass --mirror URL to use another)" >&2
		exit 1
	fi
	chroot "$tmp" /usr/bin/apt-get clean
	rm -rf "$tmp"/var/lib/apt/lists/* "$tmp"/var/cache/apt/*.bin "$tmp"/var/log/*.log "$tmp"/var/log/apt/* \
		"$tmp"/usr/share/doc/* "$tmp"/usr/share/man/*
	: >"$tmp/etc/resolv.conf"
}

# build_py_sci adds Debian's pip, numpy and pillow to a copy of py-3.11.
build_py_sci() {
	if stamp_ok py-sci-3.11; then
		log "py-sci-3.11: cached at $CACHE/py-sci-3.11 (version $BUILD_VERSION)"
		return 0
	fi
	build_py
	[ -n "$MIRROR" ] || MIRROR="$(detect_mirror)"
	local tmp="$CACHE/py-sci-3.11.tmp" start=$SECONDS
	cleanup_dir "$tmp"
	cp -a "$CACHE/py-3.11" "$tmp"
	chroot_apt_install "$tmp" py-sci-3.11 python3-pip python3-numpy python3-pil
	# As in E2B's images, `pip install` installs (Debian marks its python
	# externally managed, which turns every install into an error).
	rm -f "$tmp"/usr/lib/python3*/EXTERNALLY-MANAGED
	chroot "$tmp" /usr/bin/python3 -c 'import numpy, PIL, pip' || { echo "build.sh: numpy, PIL or pip missing in py-sci" >&2; exit 1; }
	publish py-sci-3.11 "$tmp"
	log "py-sci-3.11: done in $((SECONDS - start))s, $(du -sh "$CACHE/py-sci-3.11" | cut -f1) at $CACHE/py-sci-3.11"
}

# The base images' version: theirs and that of py-3.11 they are built on.
BASE_STAMP="$BUILD_VERSION.$BASE_VERSION"

# build_base makes E2B's "base" template from a copy of py-3.11: Debian's
# python-is-python3, pip, nodejs and npm, git, curl, wget, sudo (user may
# run anything as root without a password, as in E2B), iproute2 and
# netcat-openbsd.
build_base() {
	if stamp_ok base "$BASE_STAMP"; then
		log "base: cached at $CACHE/base (version $BASE_STAMP)"
		return 0
	fi
	build_py
	[ -n "$MIRROR" ] || MIRROR="$(detect_mirror)"
	local tmp="$CACHE/base.tmp" start=$SECONDS
	cleanup_dir "$tmp"
	cp -a "$CACHE/py-3.11" "$tmp"
	chroot_apt_install "$tmp" base python-is-python3 python3-pip python3-venv nodejs npm git curl wget \
		sudo ca-certificates procps iproute2 netcat-openbsd
	rm -f "$tmp"/usr/lib/python3*/EXTERNALLY-MANAGED
	# npm's own docs and man pages (~10 MB), never read in a sandbox.
	rm -rf "$tmp"/usr/share/nodejs/npm/docs "$tmp"/usr/share/nodejs/npm/man
	printf 'user ALL=(ALL:ALL) NOPASSWD: ALL\n' >"$tmp/etc/sudoers.d/user"
	chmod 0440 "$tmp/etc/sudoers.d/user"
	chroot "$tmp" /usr/sbin/usermod -aG sudo user
	chroot "$tmp" /usr/sbin/visudo -cq || { cleanup_dir "$tmp"; echo "build.sh: sudoers of base do not parse" >&2; exit 1; }
	local v
	for v in "python --version" "python3 -m pip --version" "node --version" "npm --version" "git --version" \
		"curl --version" "wget --version" "sudo --version" "ip -V" "command -v nc" "command -v ps"; do
		chroot "$tmp" /bin/sh -c "$v" >/dev/null 2>&1 || { cleanup_dir "$tmp"; echo "build.sh: '$v' fails in base" >&2; exit 1; }
	done
	publish base "$tmp" "$BASE_STAMP"
	log "base: done in $((SECONDS - start))s, $(du -sh "$CACHE/base" | cut -f1) at $CACHE/base ($(chroot "$CACHE/base" node --version), $(chroot "$CACHE/base" python --version))"
}

# build_code_interpreter makes E2B's "code-interpreter-v1" template from a
# copy of base: Debian's numpy, pandas, matplotlib and pillow.
build_code_interpreter() {
	if stamp_ok code-interpreter "$BASE_STAMP"; then
		log "code-interpreter: cached at $CACHE/code-interpreter (version $BASE_STAMP)"
		return 0
	fi
	build_base
	[ -n "$MIRROR" ] || MIRROR="$(detect_mirror)"
	local tmp="$CACHE/code-interpreter.tmp" start=$SECONDS
	cleanup_dir "$tmp"
	cp -a "$CACHE/base" "$tmp"
	# python3-munkres satisfies fonttools' "munkres or scipy": scipy would
	# bring pythran, a C++ toolchain and boost (600 MB more).
	chroot_apt_install "$tmp" code-interpreter python3-numpy python3-pandas python3-matplotlib python3-pil \
		python3-munkres
	# matplotlib's font cache, made once here instead of at every
	# sandbox's first import (seconds).
	chroot "$tmp" /usr/sbin/runuser -u user -- env HOME=/home/user MPLBACKEND=Agg \
		/usr/bin/python3 -c 'import numpy, pandas, matplotlib.pyplot, PIL, pip' ||
		{ cleanup_dir "$tmp"; echo "build.sh: numpy, pandas, matplotlib, PIL or pip missing in code-interpreter" >&2; exit 1; }
	publish code-interpreter "$tmp" "$BASE_STAMP"
	log "code-interpreter: done in $((SECONDS - start))s, $(du -sh "$CACHE/code-interpreter" | cut -f1) at $CACHE/code-interpreter"
}

# opendsec_cmd finds the binary with `image import-rootfs`: --opendsec,
# $OPENDSEC_BIN, PATH, else `go run` from this checkout.
opendsec_cmd() {
	if [ -n "$OPENDSEC_BIN" ]; then echo "$OPENDSEC_BIN"; return; fi
	if command -v opendsec >/dev/null; then command -v opendsec; return; fi
	if [ -d "$REPO_DIR/cmd/opendsec" ] && command -v go >/dev/null; then
		log "building cmd/opendsec from $REPO_DIR" >&2
		(cd "$REPO_DIR" && go build -o "$CACHE/.opendsec" ./cmd/opendsec) >&2
		echo "$CACHE/.opendsec"
		return
	fi
	echo "build.sh: no opendsec binary: pass --opendsec PATH, put it on PATH, or use --no-import" >&2
	exit 1
}

import_one() { # name rootfs args...
	local name="$1" rootfs="$2"
	shift 2
	log "importing $name from $rootfs into $DATA_DIR"
	"$OPENDSEC" image import-rootfs --data-dir "$DATA_DIR" --name "$name" --rootfs "$rootfs" "$@"
}

PATH_ENV="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

if [ -z "$ONLY" ] || [ "$ONLY" = busybox ]; then build_busybox; fi
if [ -z "$ONLY" ] || [ "$ONLY" = py ]; then build_py; fi
if [ -z "$ONLY" ] || [ "$ONLY" = py-sci ]; then build_py_sci; fi
if [ -z "$ONLY" ] || [ "$ONLY" = base ]; then build_base; fi
if [ -z "$ONLY" ] || [ "$ONLY" = code-interpreter ]; then build_code_interpreter; fi

if [ "$DO_IMPORT" -eq 1 ]; then
	OPENDSEC="$(opendsec_cmd)"
	if [ -z "$ONLY" ] || [ "$ONLY" = busybox ]; then
		import_one root/busybox "$CACHE/busybox" --env "$PATH_ENV" --workdir /home/user --user user
	fi
	if [ -z "$ONLY" ] || [ "$ONLY" = py ]; then
		import_one root/py:3.11 "$CACHE/py-3.11" --env "$PATH_ENV" --env LANG=C.UTF-8 \
			--env PYTHONUNBUFFERED=1 --workdir /home/user --user user
	fi
	if [ -z "$ONLY" ] || [ "$ONLY" = py-sci ]; then
		import_one root/py-sci:3.11 "$CACHE/py-sci-3.11" --env "$PATH_ENV" --env LANG=C.UTF-8 \
			--env PYTHONUNBUFFERED=1 --workdir /home/user --user user
	fi
	if [ -z "$ONLY" ] || [ "$ONLY" = base ]; then
		import_one root/base "$CACHE/base" --env "$PATH_ENV" --env LANG=C.UTF-8 \
			--env PYTHONUNBUFFERED=1 --workdir /home/user --user user
	fi
	if [ -z "$ONLY" ] || [ "$ONLY" = code-interpreter ]; then
		import_one root/code-interpreter "$CACHE/code-interpreter" --env "$PATH_ENV" --env LANG=C.UTF-8 \
			--env PYTHONUNBUFFERED=1 --env MPLBACKEND=Agg --workdir /home/user --user user
	fi
fi
log "done"
