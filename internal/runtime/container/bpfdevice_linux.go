package container

import (
	"errors"
	"fmt"
	goruntime "runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// On cgroup v2 a container's devices cgroup is an eBPF program attached
// to its cgroup. crun puts its built-in rules, /dev/console (c 5:1)
// among them, before config.json's, so no rule there takes that device
// back (on v1 the node writes devices.deny after crun: ociRuntime.afterInit).
// denyConsoleBPF attaches, once, to the sandboxes' parent cgroup a device
// program that refuses c 5:1 and allows everything else, with
// BPF_F_ALLOW_MULTI: the kernel then runs it beside every sandbox's own
// program (crun's or runc's) and a device is usable only if all of them
// allow it.

// bpfInsn is one eBPF instruction (struct bpf_insn).
type bpfInsn struct {
	code uint8
	regs uint8 // dst in the low nibble, src in the high one
	off  int16
	imm  int32
}

// denyDeviceInsns returns a device program (struct bpf_cgroup_dev_ctx
// in r1): r2 = access_type & 0xffff (the device type), r3 = major, r4 =
// minor; return 0 for the char device major:minor, else 1.
func denyDeviceInsns(major, minor int32) []bpfInsn {
	const devCgDevChar = 2 // BPF_DEVCG_DEV_CHAR
	return []bpfInsn{
		{code: 0x61, regs: 0x12, off: 0},                    // r2 = *(u32 *)(r1 + 0)
		{code: 0x57, regs: 0x02, imm: 0xffff},               // r2 &= 0xffff
		{code: 0x61, regs: 0x13, off: 4},                    // r3 = *(u32 *)(r1 + 4)
		{code: 0x61, regs: 0x14, off: 8},                    // r4 = *(u32 *)(r1 + 8)
		{code: 0x55, regs: 0x02, off: 4, imm: devCgDevChar}, // if r2 != char goto allow
		{code: 0x55, regs: 0x03, off: 3, imm: major},        // if r3 != major goto allow
		{code: 0x55, regs: 0x04, off: 2, imm: minor},        // if r4 != minor goto allow
		{code: 0xb7, regs: 0x00, imm: 0},                    // r0 = 0 (deny)
		{code: 0x95},                                        // exit
		{code: 0xb7, regs: 0x00, imm: 1},                    // allow: r0 = 1
		{code: 0x95},                                        // exit
	}
}

// denyConsoleProgName is the program's name (bpftool prog shows it).
const denyConsoleProgName = "odsec_nocons"

// denyConsoleBPF attaches the program refusing /dev/console (c 5:1) to the
// cgroup v2 directory dir (denyCharDeviceBPF).
func denyConsoleBPF(dir string) error { return denyCharDeviceBPF(dir, 5, 1) }

// denyCharDeviceBPF attaches a program refusing the char device
// major:minor to the cgroup v2 directory dir, unless a program attached
// with BPF_F_ALLOW_MULTI is already there (one an earlier start of the
// node attached: attachments outlive the process).
func denyCharDeviceBPF(dir string, major, minor int32) error {
	cg, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open cgroup %s: %w", dir, err)
	}
	defer unix.Close(cg)
	query := struct {
		targetFd    uint32
		attachType  uint32
		queryFlags  uint32
		attachFlags uint32
		progIDs     uint64
		progCnt     uint32
		_           uint32
	}{targetFd: uint32(cg), attachType: unix.BPF_CGROUP_DEVICE} //nolint:gosec // an fd fits
	if _, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_QUERY, uintptr(unsafe.Pointer(&query)), unsafe.Sizeof(query)); errno != 0 {
		return fmt.Errorf("query device programs of cgroup %s: %w", dir, errno)
	}
	if query.progCnt > 0 && query.attachFlags&unix.BPF_F_ALLOW_MULTI != 0 {
		return nil
	}
	insns := denyDeviceInsns(major, minor)
	license := []byte("Apache-2.0\x00")
	load := struct {
		progType           uint32
		insnCnt            uint32
		insns              uint64
		license            uint64
		logLevel           uint32
		logSize            uint32
		logBuf             uint64
		kernVersion        uint32
		progFlags          uint32
		progName           [16]byte
		progIfindex        uint32
		expectedAttachType uint32
	}{
		progType:           unix.BPF_PROG_TYPE_CGROUP_DEVICE,
		insnCnt:            uint32(len(insns)),
		insns:              uint64(uintptr(unsafe.Pointer(&insns[0]))),
		license:            uint64(uintptr(unsafe.Pointer(&license[0]))),
		expectedAttachType: unix.BPF_CGROUP_DEVICE,
	}
	copy(load.progName[:], denyConsoleProgName)
	prog, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_LOAD, uintptr(unsafe.Pointer(&load)), unsafe.Sizeof(load))
	goruntime.KeepAlive(license)
	goruntime.KeepAlive(insns)
	if errno != 0 {
		return fmt.Errorf("load the device program: %w", errno)
	}
	defer unix.Close(int(prog))
	attach := struct {
		targetFd     uint32
		attachBpfFd  uint32
		attachType   uint32
		attachFlags  uint32
		replaceBpfFd uint32
	}{targetFd: uint32(cg), attachBpfFd: uint32(prog), attachType: unix.BPF_CGROUP_DEVICE, attachFlags: unix.BPF_F_ALLOW_MULTI} //nolint:gosec // fds fit
	if _, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_ATTACH, uintptr(unsafe.Pointer(&attach)), unsafe.Sizeof(attach)); errno != 0 {
		if errors.Is(errno, unix.EPERM) {
			return fmt.Errorf("attach the device program to cgroup %s (a program above it forbids more): %w", dir, errno)
		}
		return fmt.Errorf("attach the device program to cgroup %s: %w", dir, errno)
	}
	return nil
}
