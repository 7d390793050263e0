#!/usr/bin/env bash
# Build the VM guest assets (kernel + initramfs) from Debian packages. See docs/vm-guest.md.
# Usage: scripts/build-guest-assets.sh [--cache DIR]   (env OPENDSEC_GUEST_CACHE, default /var/cache/opendsec/guest)
# Prints the asset directory on the last line of stdout. Idempotent: an unchanged input set reuses the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${OPENDSEC_GUEST_CACHE:-/var/cache/opendsec/guest}
[ "${1:-}" = "--cache" ] && CACHE=$2
GO=${GO:-go}

# Modules wanted; dependencies are resolved from .modinfo depends= and placed first.
WANT="crc32c_generic virtio_mmio virtio_pci virtio_console virtio_blk virtio_net erofs ext4 overlay virtio_balloon virtio_rng vmw_vsock_virtio_transport virtio_pmem nd_pmem"

# The kernel package linux-image-amd64 depends on (the metapackage's candidate).
KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
[ -n "$KPKG" ] || { echo "guest assets: cannot resolve linux-image-amd64's kernel package (apt-get update?)" >&2; exit 1; }
KVER=${KPKG#linux-image-}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
CGO_ENABLED=0 "$GO" build -trimpath -ldflags '-s -w' -o "$work/bin/opendsec-agent" ./cmd/opendsec-agent
CGO_ENABLED=0 "$GO" build -trimpath -ldflags '-s -w' -o "$work/bin/opendsec-guestinit" ./cmd/opendsec-guestinit

hash=$(cat scripts/build-guest-assets.sh "$work/bin/opendsec-guestinit" "$work/bin/opendsec-agent" <(echo "$KPKG $WANT") | sha256sum | cut -c1-16)
OUT="$CACHE/$KVER-$hash"
if [ -f "$OUT/manifest.json" ] && (cd "$OUT" && sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1); then
  echo "guest assets: cached ($KPKG)" >&2
  ln -sfn "$(basename "$OUT")" "$CACHE/current"   # the vm backend's default assets_dir
  echo "$OUT"; exit 0
fi

# Debian packages, cached across input changes (they do not depend on the hash).
DEBS="$CACHE/debs"; mkdir -p "$DEBS"
(cd "$DEBS" && { ls "${KPKG}"_*.deb >/dev/null 2>&1 || apt-get download "$KPKG" >&2; } \
            && { ls busybox-static_*.deb >/dev/null 2>&1 || apt-get download busybox-static >&2; })
dpkg -x "$(ls "$DEBS/${KPKG}"_*.deb | head -1)" "$work/kpkg"
dpkg -x "$(ls "$DEBS"/busybox-static_*.deb | head -1)" "$work/bbpkg"
KDEBVER=$(dpkg-deb -f "$(ls "$DEBS/${KPKG}"_*.deb | head -1)" Version)

python3 - "$work" "$KVER" "$WANT" <<'PY'
import lzma, os, re, sys, json, shutil
work, kver, want = sys.argv[1], sys.argv[2], sys.argv[3].split()
d = open(f'{work}/kpkg/boot/vmlinuz-{kver}', 'rb').read()
i = d.find(b'\xfd7zXZ\x00')
if i < 0: sys.exit('guest assets: no XZ stream in the bzImage')
open(f'{work}/vmlinux', 'wb').write(lzma.LZMADecompressor().decompress(d[i:]))
cfg = open(f'{work}/kpkg/boot/config-{kver}').read()
mods = {}
for dp, _, fs in os.walk(f'{work}/kpkg/lib/modules/{kver}/kernel'):
    for f in fs:
        if f.endswith('.ko'):
            mods[f[:-3].replace('-', '_')] = os.path.join(dp, f)
def deps(n):
    m = re.search(rb'(?:^|\x00)depends=([^\x00]*)', open(mods[n], 'rb').read())
    return [x.replace('-', '_') for x in m.group(1).decode().split(',') if x] if m else []
order, seen = [], set()
def visit(n):
    if n in seen: return
    seen.add(n)
    for x in deps(n): visit(x)
    order.append(n)
builtin = []
for n in want:
    if n in mods: visit(n)
    else: builtin.append(n)  # built in (or absent): recorded, not loaded
# virtio_pci's helper modules come right after virtio_mmio as in the reference; dependency order already holds.
os.makedirs(f'{work}/root/lib/modules', exist_ok=True)
for n in order:
    shutil.copy(mods[n], f'{work}/root/lib/modules/{n}.ko')
open(f'{work}/root/lib/modules/order', 'w').write('\n'.join(order) + '\n')
# pmem layers need virtio_pmem and nd_pmem, as modules in the initramfs or
# built into the kernel.
def have(n, opt):
    return n in order or re.search(rf'^{opt}=y$', cfg, re.M) is not None
pmem = have('virtio_pmem', 'CONFIG_VIRTIO_PMEM') and have('nd_pmem', 'CONFIG_BLK_DEV_PMEM')
json.dump({'order': order, 'not_modules': builtin, 'pmem': pmem}, open(f'{work}/mods.json', 'w'))
PY

R=$work/root
mkdir -p "$R"/{bin,sbin,dev,proc,sys,run,tmp,mnt,etc}
cp "$work/bin/opendsec-guestinit" "$R/init"
cp "$work/bin/opendsec-agent" "$R/bin/opendsec-agent"
cp "$work/bbpkg/bin/busybox" "$R/bin/busybox"
for a in sh ip mount umount mkdir cat ls mkfs.ext2 nc; do ln -sf busybox "$R/bin/$a"; done
(cd "$R" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --reproducible --quiet) > "$work/initrd.cpio"

tmp="$OUT.tmp.$$"; rm -rf "$tmp"; mkdir -p "$tmp"
mv "$work/vmlinux" "$work/initrd.cpio" "$tmp/"
python3 - "$tmp" "$KPKG" "$KDEBVER" "$KVER" "$work/mods.json" <<'PY'
import hashlib, json, sys
d, pkg, debver, kver, mj = sys.argv[1:]
m = json.load(open(mj))
sha = {f: hashlib.sha256(open(f'{d}/{f}', 'rb').read()).hexdigest() for f in ('vmlinux', 'initrd.cpio')}
json.dump({'kernel_package': pkg, 'kernel_package_version': debver, 'kernel_version': kver,
           'modules': m['order'], 'builtin_or_absent': m['not_modules'], 'sha256': sha,
           # What this guest init serves that an older one did not; the vm
           # backend turns a feature on only where the assets list it.
           'features': ['balloon-control'] + (['pmem-layers'] if m['pmem'] else [])},
          open(f'{d}/manifest.json', 'w'), indent=2)
PY
(cd "$tmp" && sha256sum vmlinux initrd.cpio manifest.json > SHA256SUMS)
rm -rf "$OUT"; mv "$tmp" "$OUT"
ln -sfn "$(basename "$OUT")" "$CACHE/current"
echo "guest assets: built $KPKG ($KDEBVER) into $OUT" >&2
echo "$OUT"
