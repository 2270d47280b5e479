# Stage 2 (PID 1 on the overlay root; see init.sh): mount what a node has, run /cmd, report its
# exit status on the console and through isa-debug-exit. Busybox applets by full path until
# the command: the host's tools are used only for what busybox lacks.
bb=/.sidestep-vm/busybox
. /.sidestep-vm/conf
$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
$bb mount -t devtmpfs devtmpfs /dev
# The kernel's modules: the host root has none for this release. kmod and module autoload
# (request_module -> /sbin/modprobe) then work as on a real node.
$bb mkdir -p /lib/modules/$KVER
$bb mount --bind "$KROOT/lib/modules/$KVER" /lib/modules/$KVER \
  || echo "sidestep-vm: no modules at $KROOT/lib/modules/$KVER: autoload will fail"
$bb mkdir -p /dev/pts /dev/shm
$bb mount -t devpts -o newinstance,ptmxmode=0666,gid=5,mode=620 devpts /dev/pts
$bb ln -sf pts/ptmx /dev/ptmx
# Fresh, not overlays: the host's /run (its netns bind mounts, which 9p would show as plain
# files) and /dev/shm must not show through. /tmp stays the overlay's: a checkout under /tmp
# (CI's fresh clone may be one) must be visible, and writes still land in the guest's tmpfs.
$bb mount -t tmpfs -o mode=1777 shm /dev/shm
$bb mount -t tmpfs -o mode=0755 run /run
$bb mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
$bb mount -t bpf -o mode=0700 bpffs /sys/fs/bpf
$bb mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
$bb mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
$bb mount -t securityfs securityfs /sys/kernel/security 2>/dev/null
# No udev: tun's node is made by hand, and the module then autoloads on open.
$bb mkdir -p /dev/net; [ -e /dev/net/tun ] || $bb mknod -m 666 /dev/net/tun c 10 200
$bb hostname sidestep-vm
# No CRLF in the output the host captures.
$bb stty -F /dev/console -onlcr 2>/dev/null
# SIDESTEP_VM_MODULES: modules to load up front (br_netfilter never autoloads).
[ -n "$RUN_MODS" ] && /sbin/modprobe -a -q $RUN_MODS
missing=""
for m in $RUN_MODS; do
  m2=$(echo $m | $bb tr - _)
  [ -d /sys/module/$m2 ] || missing="$missing $m"
done
[ -n "$missing" ] && echo "sidestep-vm: modules not loaded:$missing"
/sbin/ip link set lo up
echo "sidestep-vm: $($bb cut -d' ' -f1 /proc/uptime)s since boot, running the command"
set -a; . /.sidestep-vm/env; set +a
/bin/sh /.sidestep-vm/cmd </dev/null >/dev/console 2>&1
rc=$?
# The host reads this line first: isa-debug-exit carries at most 126 distinct codes.
echo "sidestep-vm: exit status $rc (after $($bb cut -d' ' -f1 /proc/uptime)s)"
v=$((rc + 1)); [ $v -gt 127 ] && v=127
# isa-debug-exit: qemu exits with (v << 1) | 1
$bb printf "\\$($bb printf %o $v)" | $bb dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
echo o >/proc/sysrq-trigger
