#!/bin/busybox sh
# Stage 1 (PID 1 in the initramfs, built by xtask/src/vm/initramfs.rs): load the 9p stack, mount
# the host's / read-only with a tmpfs overlay on top, switch into it and run stage 2 there.
# switch_root, not chroot: runc's pivot_root and `ip netns` then behave as on a node.
/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
# A poweroff ends qemu with no exit status, which the host reports as a VM failure.
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
# switch_root needs the next init inside the new root: this lands in the tmpfs upper layer.
mkdir -p /newroot/.sidestep-vm
cp /bin/busybox /stage2 /cmd /env /conf /newroot/.sidestep-vm/ || die "copy stage 2"
umount /proc /sys /dev
exec switch_root /newroot /.sidestep-vm/busybox sh /.sidestep-vm/stage2
