#!/usr/bin/env bash
# Builds the test bed's guest VM image from Debian's packages into a version-keyed cache outside
# the repo: a stock Debian kernel (vmlinuz + the few modules a virtio-scsi guest needs) and an
# initramfs with busybox-static, udev (systemd-udevd, udevadm, scsi_id, 60-persistent-storage.rules),
# e2fsprogs, xfsprogs, util-linux (blkid, mount, umount, setpriv), qemu-guest-agent and the NFS
# client (the kernel's nfs/nfsv4 modules and nfs-common's mount.nfs, for RWX volumes), each
# binary with the libraries `ldd` names. Idempotent: a second run only checks.
#
#   tests/scripts/guest.sh              # build (as root: installs qemu-system-x86 and cpio)
#   tests/scripts/guest.sh --print-dir  # prints the image directory and exits
#
# The guest's /init reads switches from the kernel command line, so one image serves all VMs:
#   guest.udev=0     do not start udev (no /dev/disk/by-id links; disks only in sysfs)
#   guest.agent=0    do not start qemu-guest-agent
#   guest.shell=PORT the command channel's TCP port (default 2222): one `sh` per connection
# It loads the modules, brings up eth0 (10.0.2.15/24 via 10.0.2.2, QEMU's user network), mounts
# the 9p share `hostshare` at /mnt/share, optionally starts udev and qemu-ga, prints
# `GUEST-READY` on the console and serves the command channel.
set -euo pipefail

# Bump when the image's content or /init changes: the directory name carries it.
GUEST_REV=3
CACHE_ROOT=${HARVESTER_TESTBED_CACHE:-$HOME/.cache/harvester-testbed}
say() { printf '[guest] %s\n' "$*"; }
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

# The kernel package that linux-image-amd64 points at, and the candidate versions of the rest.
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -n1; }
candidate() { apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p' | sed 's/^[0-9]*://; s/[^A-Za-z0-9.+~-]/_/g'; }

KPKG=$(kernel_pkg)
if [ -z "$KPKG" ] && [ "$(id -u)" = 0 ]; then
  apt_update_once # a new machine's apt lists are empty until the first update
  KPKG=$(kernel_pkg)
fi
if [ -z "$KPKG" ]; then
  say "apt-cache knows no linux-image-amd64 dependency: run apt-get update" >&2
  exit 1
fi
KVER=${KPKG#linux-image-}
GUEST_DIR="$CACHE_ROOT/guest-r$GUEST_REV-linux$KVER-busybox$(candidate busybox-static)-udev$(candidate udev)-qga$(candidate qemu-guest-agent)"

if [ "${1:-}" = "--print-dir" ]; then echo "$GUEST_DIR"; exit 0; fi

# --- host packages: QEMU to run the guest, cpio to pack the initramfs ---------------------------
install_debs --no-install-recommends -- qemu-system-x86 cpio e2fsprogs xfsprogs util-linux mount

if [ -f "$GUEST_DIR/vmlinuz" ] && [ -f "$GUEST_DIR/initramfs.cpio" ]; then
  say "guest image ready in $GUEST_DIR"
  exit 0
fi

start=$(date +%s)
say "building $GUEST_DIR"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/x" "$work/k"
cd "$work/debs"
# Guest-only packages are downloaded, never installed on the host. qemu-ga's libraries that a
# host usually lacks come from their packages too.
apt-get download -qq "$KPKG" busybox-static udev qemu-guest-agent libglib2.0-0 libnuma1 liburing2 \
  nfs-common libtirpc3 libtirpc-common libnfsidmap1 libkeyutils1 \
  2>&1 | grep -v 'unsandboxed' || true
for d in *.deb; do
  case "$d" in
    linux-image-*) ;;
    *) dpkg -x "$d" "$work/x" ;;
  esac
done

# --- kernel: vmlinuz and the modules, in load order ------------------------------------------
MODULES=(virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci
  scsi_common scsi_mod virtio_scsi crc64 crc64-rocksoft crct10dif_common crc-t10dif t10-pi sd_mod
  failover net_failover virtio_net crc16 mbcache jbd2 ext4 crc32c_generic libcrc32c xfs
  9pnet 9pnet_virtio netfs fscache 9p virtio_console
  sunrpc grace lockd dns_resolver nfs nfsv4)
dpkg-deb --fsys-tarfile linux-image-*.deb \
  | tar -x -C "$work/k" --wildcards "./boot/vmlinuz-$KVER" "./lib/modules/$KVER/kernel/*"
R="$work/root"
mkdir -p "$R"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,usr/lib/udev/rules.d,etc/udev/rules.d,lib/modules,dev,proc,sys,run,tmp,var,mnt/share,root}
ln -s usr/bin "$R/bin"; ln -s usr/sbin "$R/sbin"; ln -s usr/lib64 "$R/lib64"
ln -s ../run "$R/var/run"
# /lib holds the modules directory the init loads from; libraries go to usr/lib (merged /usr).
ln -s ../usr/lib/x86_64-linux-gnu "$R/lib/x86_64-linux-gnu"
ln -s ../usr/lib/udev "$R/lib/udev"
: >"$R/etc/modules-order"
for m in "${MODULES[@]}"; do
  f=$(find "$work/k/lib/modules/$KVER/kernel" \( -name "$m.ko" -o -name "${m//-/_}.ko" -o -name "${m//_/-}.ko" \) | head -n1)
  if [ -z "$f" ]; then say "module $m is not in $KPKG" >&2; exit 1; fi
  cp "$f" "$R/lib/modules/"
  basename "$f" >>"$R/etc/modules-order"
done
cp "$work/k/boot/vmlinuz-$KVER" "$work/vmlinuz"

# --- binaries and their libraries ----------------------------------------------------------------
LIBPATH="$work/x/usr/lib/x86_64-linux-gnu:$work/x/lib/x86_64-linux-gnu"
# copy_bin SRC DEST: the binary (dereferenced) and every library ldd resolves for it.
copy_bin() {
  local src=$1 dest=$2 lib
  install -D -m 0755 "$(readlink -f "$src")" "$R$dest"
  if ! LD_LIBRARY_PATH="$LIBPATH" ldd "$src" >/dev/null 2>&1; then return 0; fi  # static
  if LD_LIBRARY_PATH="$LIBPATH" ldd "$src" | grep -q 'not found'; then
    say "libraries of $src not found:" >&2
    LD_LIBRARY_PATH="$LIBPATH" ldd "$src" | grep 'not found' >&2
    exit 1
  fi
  for lib in $(LD_LIBRARY_PATH="$LIBPATH" ldd "$src" | awk '/=> \// {print $3} /^\t\/lib64/ {print $1}'); do
    case "$lib" in
      */ld-linux-x86-64.so.2) cp -L "$lib" "$R/usr/lib64/ld-linux-x86-64.so.2"
                              cp -L "$lib" "$R/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ;;
      *) cp -L "$lib" "$R/usr/lib/x86_64-linux-gnu/$(basename "$lib")" ;;
    esac
  done
}
cp "$work/x/bin/busybox" "$R/usr/bin/busybox"
ln -s busybox "$R/usr/bin/sh"
copy_bin "$work/x/bin/udevadm" /usr/bin/udevadm
ln -s udevadm "$R/usr/bin/systemd-udevd"
copy_bin "$work/x/lib/udev/scsi_id" /usr/lib/udev/scsi_id
cp "$work/x/lib/udev/rules.d/60-persistent-storage.rules" "$R/usr/lib/udev/rules.d/"
copy_bin "$work/x/usr/sbin/qemu-ga" /usr/sbin/qemu-ga
# NFSv4 client (RWX volumes): `mount -t nfs` runs /sbin/mount.nfs.
copy_bin "$work/x/sbin/mount.nfs" /usr/sbin/mount.nfs
ln -s mount.nfs "$R/usr/sbin/mount.nfs4"
cp "$work/x/etc/netconfig" "$R/etc/netconfig"
for b in /sbin/mke2fs /sbin/resize2fs /sbin/e2fsck /sbin/mkfs.xfs /usr/sbin/xfs_growfs \
  /sbin/blkid /bin/mount /bin/umount /usr/bin/setpriv /sbin/blockdev /usr/bin/findmnt; do
  copy_bin "$b" "/usr/sbin/$(basename "$b")"
done
ln -s mke2fs "$R/usr/sbin/mkfs.ext4"
# A Rust binary from the host (the CSI driver, through 9p) needs libgcc_s besides libc.
cp -L /lib/x86_64-linux-gnu/libgcc_s.so.1 "$R/usr/lib/x86_64-linux-gnu/"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$R/etc/passwd"
printf 'root:x:0:\ndisk:x:6:\n' >"$R/etc/group"
: >"$R/etc/fstab"
ln -s ../proc/self/mounts "$R/etc/mtab"

cat >"$R/init" <<'EOF'
#!/usr/bin/busybox sh
/usr/bin/busybox mkdir -p /bbin
/usr/bin/busybox --install -s /bbin
export PATH=/usr/sbin:/usr/bin:/bbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
log() { echo "guest-init: $*" >/dev/console; }
udev=1; agent=1; shell=2222
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    guest.udev=*) udev=${arg#guest.udev=} ;;
    guest.agent=*) agent=${arg#guest.agent=} ;;
    guest.shell=*) shell=${arg#guest.shell=} ;;
  esac
done
for m in $(cat /etc/modules-order); do
  insmod "/lib/modules/$m" 2>/dev/null || log "insmod $m failed"
done
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 hostshare /mnt/share || log "9p mount failed"
if [ "$udev" = 1 ]; then
  systemd-udevd --daemon --resolve-names=never
  udevadm trigger --action=add --subsystem-match=block --subsystem-match=scsi --subsystem-match=virtio-ports
  udevadm settle --timeout=30 || log "udevadm settle timed out"
  log "udev started"
fi
if [ "$agent" = 1 ]; then
  port=
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = org.qemu.guest_agent.0 ] && port=/dev/${p##*/}
  done
  if [ -n "$port" ]; then
    qemu-ga -d -m virtio-serial -p "$port" -f /run/qemu-ga.pid -t /run && log "qemu-ga on $port"
  else
    log "no virtio-serial port org.qemu.guest_agent.0: qemu-ga not started"
  fi
fi
log "GUEST-READY udev=$udev agent=$agent shell=$shell"
while true; do
  nc -ll -p "$shell" -e /bin/sh
  sleep 1
done
EOF
chmod 0755 "$R/init"

mkdir -p "$GUEST_DIR.tmp"
cp "$work/vmlinuz" "$GUEST_DIR.tmp/vmlinuz"
(cd "$R" && find . -print0 | sort -z | cpio --null -o -H newc --quiet) >"$GUEST_DIR.tmp/initramfs.cpio"
printf 'kernel %s\nbuilt %s\n' "$KPKG" "$(date -u +%FT%TZ)" >"$GUEST_DIR.tmp/VERSIONS"
for d in "$work"/debs/*.deb; do basename "$d" >>"$GUEST_DIR.tmp/VERSIONS"; done
rm -rf "$GUEST_DIR"
mv "$GUEST_DIR.tmp" "$GUEST_DIR"
say "built $GUEST_DIR in $(( $(date +%s) - start ))s (initramfs $(du -h "$GUEST_DIR/initramfs.cpio" | cut -f1))"
