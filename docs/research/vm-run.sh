#!/bin/bash
# vm-run.sh: run a command as root inside a qemu (TCG) VM booted from an unpacked Debian kernel
# package, with the host's root filesystem shared read-only over 9p (writes go to a tmpfs overlay).
#
# usage: vm-run.sh [options] <kernel> -- <command...>
#   <kernel>   6.1 | 6.12 | a directory name under $SIDESTEP_KERNELS (default
#              /work/main/.tools/kernels), holding an unpacked linux-image-*-amd64 .deb
#              (`dpkg-deb -x`) on which `depmod -b DIR VERSION` was run.
# options:
#   -e VAR=VAL   extra environment variable for the command (repeatable)
#   -m MEM       guest memory (default 2G)
#   -s N         guest CPUs (default 2)
#   -t SECS      kill the VM after SECS seconds (default 1800), exit 124
#   -M "mods"    modules to modprobe before the command ("all": the list below; the rest of
#                the time modules autoload on first use, br_netfilter excepted)
#   -v           show all kernel messages (default: quiet)
#   -k           keep the temp dir (initramfs, qemu command line) for debugging
#
# Exit status: the command's (0..126; 127 means 127 or more: the exact value is printed on the
# console as "sidestep-vm: exit status N"); 124 timeout; 125 the VM died without reporting
# (panic, qemu error).
set -euo pipefail

KERNELS=${SIDESTEP_KERNELS:-/work/main/.tools/kernels}
MEM=2G SMP=2 TIMEOUT=1800 VERBOSE=0 KEEP=0 EXTRA_MODS=""
ENVS=()
while getopts "e:m:s:t:M:vk" o; do
  case $o in
    e) ENVS+=("$OPTARG") ;;
    m) MEM=$OPTARG ;;
    s) SMP=$OPTARG ;;
    t) TIMEOUT=$OPTARG ;;
    M) EXTRA_MODS=$OPTARG ;;
    v) VERBOSE=1 ;;
    k) KEEP=1 ;;
    *) sed -n '2,21p' "$0" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 3 ] && [ "$2" = "--" ] || { sed -n '2,21p' "$0" >&2; exit 2; }
KROOT=$(readlink -f "$KERNELS/$1")
shift 2
# trixie packages ship /usr/lib/modules: give kmod (-d ROOT looks in ROOT/lib/modules) a lib link
[ -d "$KROOT/usr/lib/modules" ] && [ ! -e "$KROOT/lib" ] && ln -s usr/lib "$KROOT/lib"
[ -d "$KROOT/lib/modules" ] || { echo "vm-run: no unpacked kernel at $KROOT" >&2; exit 2; }
KVER=$(ls "$KROOT/lib/modules")
VMLINUZ=$KROOT/boot/vmlinuz-$KVER
# An uncompressed ELF vmlinux boots through its PVH entry: skips the in-guest xz/zstd
# decompression, which takes seconds under TCG. Extracted once from the bzImage.
if [ ! -f "$KROOT/boot/vmlinux-$KVER" ]; then
  off=$(LC_ALL=C grep -aboP '\xfd7zXZ\x00' "$VMLINUZ" | head -1 | cut -d: -f1 || true)
  if [ -n "$off" ]; then tail -c +$((off + 1)) "$VMLINUZ" | xz -dc 2>/dev/null >"$KROOT/boot/vmlinux-$KVER.tmp" || true
  else off=$(LC_ALL=C grep -aboP '\x28\xb5\x2f\xfd' "$VMLINUZ" | head -1 | cut -d: -f1 || true)
    tail -c +$((off + 1)) "$VMLINUZ" | zstd -qdc 2>/dev/null >"$KROOT/boot/vmlinux-$KVER.tmp" || true; fi
  # the decompressors complain about the bytes after the stream; the ELF is complete anyway
  [ "$(head -c4 "$KROOT/boot/vmlinux-$KVER.tmp" | od -An -c | tr -d ' ')" = '177ELF' ] \
    || { echo "vm-run: could not extract vmlinux from $VMLINUZ" >&2; exit 2; }
  mv "$KROOT/boot/vmlinux-$KVER.tmp" "$KROOT/boot/vmlinux-$KVER"
fi
[ "${SIDESTEP_VM_BZIMAGE:-0}" = 1 ] || VMLINUZ=$KROOT/boot/vmlinux-$KVER
[ -f "$KROOT/lib/modules/$KVER/modules.dep" ] || depmod -b "$KROOT" "$KVER"

# Modules the kernel needs before it can mount the host root (in dependency order), and the
# ones loaded once the root (and so the host's kmod) is there.
BOOT_MODS="virtio_pci 9pnet_virtio 9p overlay"
# Everything else autoloads on first use (request_module -> the host's /sbin/modprobe, which
# reads the package's modules through the /lib/modules/$KVER link). `-M all` preloads this list
# (costs 4-8 s of boot under TCG: ~60 modules with their dependencies and signature checks).
ALL_MODS="sch_ingress cls_bpf act_bpf veth bridge br_netfilter tun
  ip_tables iptable_nat iptable_mangle iptable_raw iptable_filter
  ip6_tables ip6table_nat ip6table_mangle ip6table_raw ip6table_filter
  xt_REDIRECT xt_owner xt_mark xt_conntrack xt_comment xt_multiport xt_socket xt_TPROXY xt_CT xt_tcpudp
  nf_tables nft_compat nft_chain_nat nft_redir nft_ct nft_tproxy nft_socket"
RUN_MODS=${SIDESTEP_VM_MODULES-}
case " $EXTRA_MODS " in *" all "*) EXTRA_MODS="${EXTRA_MODS/all/} $ALL_MODS" ;; esac
RUN_MODS="$RUN_MODS $EXTRA_MODS"

TMP=$(mktemp -d /tmp/sidestep-vm.XXXXXX)
QPID=""
cleanup() {
  [ -n "$QPID" ] && kill "$QPID" 2>/dev/null || true
  if [ "$KEEP" = 1 ]; then echo "vm-run: kept $TMP" >&2; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- initramfs -------------------------------------------------------------------------------
IR=$TMP/initramfs
mkdir -p "$IR"/{bin,dev,proc,sys,lower,upper,newroot,mods}
cp /bin/busybox "$IR/bin/busybox"            # busybox-static: no libraries needed
mknod -m 600 "$IR/dev/console" c 5 1
n=0
for p in $(for m in $BOOT_MODS; do modprobe -d "$KROOT" -S "$KVER" --show-depends "$m"; done | awk '$1 == "insmod" {print $2}'); do
  b=$(basename "$p"); b=${b%.xz}; b=${b%.zst}
  [ -e "$IR/mods/$b" ] && continue          # shared deps are listed once per module
  f=$KROOT${p#"$KROOT"}
  case $p in
    *.xz) xz -dc "$f" >"$IR/mods/$b" ;;
    *.zst) zstd -qdc "$f" >"$IR/mods/$b" ;;
    *) cp "$f" "$IR/mods/$b" ;;
  esac
  echo "$b" >>"$IR/mods/order"; n=$((n + 1))
done
touch "$IR/mods/order"

q() { printf "'%s'" "$(printf %s "$1" | sed "s/'/'\\\\''/g")"; }   # POSIX sh quoting
{
  echo "cd $(q "$PWD") || exit 126"
  printf 'exec'
  for a in "$@"; do printf ' %s' "$(q "$a")"; done
  echo
} >"$IR/cmd"
{
  echo "PATH=$(q "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:${PATH}")"
  echo "HOME=/root"; echo "TERM=dumb"; echo "LANG=C.UTF-8"; echo "USER=root"
  env | grep -E '^(RUST_[A-Z_]*|SIDESTEP_[A-Z_]*|CARGO_[A-Z_]*)=' | while IFS= read -r kv; do
    echo "${kv%%=*}=$(q "${kv#*=}")"
  done
  for kv in ${ENVS[@]+"${ENVS[@]}"}; do echo "${kv%%=*}=$(q "${kv#*=}")"; done
} >"$IR/env"
echo "KVER=$KVER KROOT=$(q "$KROOT") RUN_MODS=$(q "$(echo $RUN_MODS)")" >"$IR/conf"

cat >"$IR/init" <<'EOF'
#!/bin/busybox sh
# Stage 1 (initramfs): load the 9p stack, mount host / read-only with a tmpfs overlay on top,
# switch into it and run stage 2 there.
/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
die() { echo "sidestep-vm: stage1: $*"; echo 1 >/proc/sys/kernel/sysrq; echo o >/proc/sysrq-trigger; sleep 5; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /mods/order); do insmod /mods/$m || die "insmod $m"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose,access=any hostroot /lower \
  || die "mount 9p"
mount -t tmpfs -o mode=0755 upper /upper
mkdir -p /upper/data /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot \
  || die "mount overlay"
mkdir -p /newroot/.sidestep-vm
cp /bin/busybox /stage2 /cmd /env /conf /newroot/.sidestep-vm/
umount /proc /sys /dev
exec switch_root /newroot /.sidestep-vm/busybox sh /.sidestep-vm/stage2
EOF
cat >"$IR/stage2" <<'EOF'
# Stage 2: PID 1 on the overlay root. Busybox applets by full name: the host's tools come later.
bb=/.sidestep-vm/busybox
. /.sidestep-vm/conf
$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
$bb mount -t devtmpfs devtmpfs /dev
$bb mkdir -p /dev/pts /dev/shm
$bb mount -t devpts -o newinstance,ptmxmode=0666,gid=5,mode=620 devpts /dev/pts
$bb ln -sf pts/ptmx /dev/ptmx
$bb mount -t tmpfs -o mode=1777 shm /dev/shm
$bb mount -t tmpfs -o mode=1777 tmp /tmp
$bb mount -t tmpfs -o mode=0755 run /run
$bb mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
$bb mount -t bpf -o mode=0700 bpffs /sys/fs/bpf
$bb mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
$bb mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
$bb mount -t securityfs securityfs /sys/kernel/security 2>/dev/null
# The kernel's modules: the host root has none for this version; kmod and module autoload
# (request_module -> /sbin/modprobe) then work as on a real node.
$bb mkdir -p /lib/modules; $bb rm -rf /lib/modules/$KVER
$bb ln -s "$KROOT/lib/modules/$KVER" /lib/modules/$KVER
$bb mkdir -p /dev/net; [ -e /dev/net/tun ] || $bb mknod -m 666 /dev/net/tun c 10 200   # tun autoloads on open
$bb hostname sidestep-vm
$bb stty -F /dev/console -onlcr 2>/dev/null
[ -n "$(echo $RUN_MODS)" ] && /sbin/modprobe -a -q $RUN_MODS
missing=""
for m in $RUN_MODS; do
  m2=$(echo $m | $bb tr - _)
  [ -d /sys/module/$m2 ] || missing="$missing $m"
done
[ -n "$missing" ] && echo "sidestep-vm: modules not loaded:$missing"
/sbin/ip link set lo up
echo "sidestep-vm: $(cat /proc/uptime | $bb cut -d' ' -f1)s since boot, running the command"
set -a; . /.sidestep-vm/env; set +a
/bin/sh /.sidestep-vm/cmd </dev/null >/dev/console 2>&1
rc=$?
echo "sidestep-vm: exit status $rc (after $(cat /proc/uptime | $bb cut -d' ' -f1)s)"
v=$((rc + 1)); [ $v -gt 127 ] && v=127
# isa-debug-exit: qemu exits with (v << 1) | 1
$bb printf "\\$($bb printf %o $v)" | $bb dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
echo o >/proc/sysrq-trigger
EOF
chmod +x "$IR/init"
(cd "$IR" && find . | busybox cpio -o -H newc >"$TMP/initramfs.cpio" 2>/dev/null)

# ---- qemu ------------------------------------------------------------------------------------
APPEND="console=ttyS0 panic=-1 rdinit=/init 8250.nr_uarts=1 mitigations=off sysrq_always_enabled"
[ "$VERBOSE" = 1 ] || APPEND="$APPEND quiet loglevel=4"
QEMU=(qemu-system-x86_64 -accel tcg,thread=multi -cpu "${SIDESTEP_VM_CPU:-max}" -smp "$SMP" -m "$MEM"
  -nodefaults -no-user-config -display none -monitor none -no-reboot
  -chardev stdio,id=con,signal=on -serial chardev:con
  -kernel "$VMLINUZ" -initrd "$TMP/initramfs.cpio" -append "$APPEND"
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap
  -device isa-debug-exit,iobase=0xf4,iosize=0x01)
printf '%q ' "${QEMU[@]}" >"$TMP/qemu-cmdline"
set +e
timeout --foreground -k 10 "$TIMEOUT" nice -n 10 "${QEMU[@]}" </dev/null
s=$?
set -e
if [ $s -eq 124 ]; then echo "vm-run: timeout after ${TIMEOUT}s" >&2; exit 124; fi
if [ $s -ge 3 ] && [ $((s % 2)) -eq 1 ]; then exit $(((s - 3) / 2)); fi
echo "vm-run: VM ended without reporting an exit status (qemu status $s)" >&2
exit 125
