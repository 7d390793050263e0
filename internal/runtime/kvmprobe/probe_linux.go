package kvmprobe

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// KVM ioctls (linux/kvm.h, type 0xAE).
const (
	kvmGetAPIVersion       = 0xAE00
	kvmCreateVM            = 0xAE01
	kvmGetVCPUMmapSize     = 0xAE04
	kvmCreateVCPU          = 0xAE41
	kvmSetUserMemoryRegion = 0x4020AE46 // _IOW(0xAE, 0x46, struct kvm_userspace_memory_region)
	kvmSetTSSAddr          = 0xAE47
	kvmRun                 = 0xAE80
	kvmGetRegs             = 0x8090AE81 // _IOR(0xAE, 0x81, struct kvm_regs)
	kvmSetRegs             = 0x4090AE82
	kvmGetSregs            = 0x8138AE83 // _IOR(0xAE, 0x83, struct kvm_sregs)
	kvmSetSregs            = 0x4138AE84

	kvmExitHLT  = 5
	kvmExitIntr = 10
)

type kvmUserspaceMemoryRegion struct {
	Slot          uint32
	Flags         uint32
	GuestPhysAddr uint64
	MemorySize    uint64
	UserspaceAddr uint64
}

type kvmRegs struct {
	RAX, RBX, RCX, RDX, RSI, RDI, RSP, RBP uint64
	R8, R9, R10, R11, R12, R13, R14, R15   uint64
	RIP, RFLAGS                            uint64
}

type kvmSegment struct {
	Base                         uint64
	Limit                        uint32
	Selector                     uint16
	Type, Present, DPL, DB, S, L uint8
	G, AVL, Unusable, Padding    uint8
}

type kvmDtable struct {
	Base    uint64
	Limit   uint16
	Padding [3]uint16
}

type kvmSregs struct {
	CS, DS, ES, FS, GS, SS, TR, LDT kvmSegment
	GDT, IDT                        kvmDtable
	CR0, CR2, CR3, CR4, CR8         uint64
	EFER, APICBase                  uint64
	InterruptBitmap                 [4]uint64
}

// Compile-time checks that the structs match the kernel's sizes.
var (
	_ [144]byte = [unsafe.Sizeof(kvmRegs{})]byte{}
	_ [312]byte = [unsafe.Sizeof(kvmSregs{})]byte{}
	_ [32]byte  = [unsafe.Sizeof(kvmUserspaceMemoryRegion{})]byte{}
)

// probeLoops is the loop count: 1 + 2*probeLoops + 1 instructions.
const probeLoops = 100000

// probeCode is the 16-bit guest: mov ecx,100000; l: dec ecx; jnz l; hlt.
var probeCode = []byte{
	0x66, 0xB9, probeLoops & 0xff, probeLoops >> 8 & 0xff, probeLoops >> 16 & 0xff, probeLoops >> 24 & 0xff, // mov ecx, imm32
	0x66, 0x49, // dec ecx
	0x75, 0xFC, // jnz -4
	0xF4, // hlt
}

const (
	guestMemSize = 0x10000 // 64 KiB at guest physical 0
	codeAddr     = 0x1000
)

func ioctl(fd int, req uintptr, arg uintptr) (uintptr, error) {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, arg)
	if errno != 0 {
		return r, errno
	}
	return r, nil
}

// observe collects the facts Decide needs from this host.
func observe(ctx context.Context, opts Options) Facts {
	f := Facts{DevPath: opts.DevPath, Modules: modules("/sys/module")}
	checkPVM(ctx, opts, &f)
	kvm, err := unix.Open(opts.DevPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		f.DevErr = err.Error()
		return f
	}
	v, err := ioctl(kvm, kvmGetAPIVersion, 0)
	if err != nil {
		unix.Close(kvm)
		f.DevErr = "KVM_GET_API_VERSION: " + err.Error()
		return f
	}
	f.APIVersion = int(v)
	if f.APIVersion != 12 {
		unix.Close(kvm)
		return f
	}
	vm, err := ioctl(kvm, kvmCreateVM, 0)
	if err != nil {
		unix.Close(kvm)
		f.CreateVMErr = "KVM_CREATE_VM: " + err.Error()
		return f
	}
	pctx, cancel := context.WithTimeout(ctx, opts.ProbeTimeout)
	defer cancel()
	// The probe owns (and closes) both descriptors: it may outlive this
	// call if a KVM_RUN never returns.
	p := runProbe(pctx, kvm, int(vm), probeCode)
	f.ProbeErr, f.ProbeInstructions, f.ProbeDuration, f.ProbeWall = p.err, p.instructions, p.cpu, p.wall
	return f
}

type probeResult struct {
	err          string
	instructions int64
	cpu, wall    time.Duration
}

// runProbe runs the timed loop on its own locked OS thread. If ctx ends
// first it sets immediate_exit and signals the thread so KVM_RUN returns;
// if even that does not work the thread is abandoned (it closes its
// descriptors when, if ever, KVM_RUN returns), so the node never hangs.
func runProbe(ctx context.Context, kvm, vm int, code []byte) probeResult {
	done := make(chan probeResult, 1)
	var tid atomic.Int32
	var stop atomic.Bool
	var runPtr atomic.Pointer[byte] // kvm_run's immediate_exit byte
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		tid.Store(int32(unix.Gettid()))
		defer unix.Close(kvm)
		defer unix.Close(vm)
		done <- probeThread(kvm, vm, code, &stop, &runPtr)
	}()
	select {
	case r := <-done:
		return r
	case <-ctx.Done():
	}
	stop.Store(true)
	if p := runPtr.Load(); p != nil {
		*p = 1 // immediate_exit: the next KVM_RUN returns EINTR at once
	}
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	deadline := time.After(time.Second)
	for {
		if id := tid.Load(); id != 0 {
			_ = unix.Tgkill(unix.Getpid(), int(id), unix.SIGURG) // interrupts a running KVM_RUN; Go ignores SIGURG
		}
		select {
		case r := <-done:
			if r.err == "" {
				return r
			}
			return probeResult{err: fmt.Sprintf("no HLT before the probe's deadline (%v)", ctx.Err())}
		case <-t.C:
		case <-deadline:
			return probeResult{err: fmt.Sprintf("KVM_RUN did not return 1s after the probe's deadline (%v) and was abandoned", ctx.Err())}
		}
	}
}

func probeThread(kvm, vm int, code []byte, stop *atomic.Bool, runPtr *atomic.Pointer[byte]) probeResult {
	fail := func(what string, err error) probeResult { return probeResult{err: what + ": " + err.Error()} }
	mem, err := unix.Mmap(-1, 0, guestMemSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return fail("guest memory", err)
	}
	// mem stays mapped for the VM's life; unmapped after the fds close.
	defer func() { _ = unix.Munmap(mem) }()
	copy(mem[codeAddr:], code)
	region := kvmUserspaceMemoryRegion{MemorySize: guestMemSize, UserspaceAddr: uint64(uintptr(unsafe.Pointer(&mem[0])))}
	if _, err := ioctl(vm, kvmSetUserMemoryRegion, uintptr(unsafe.Pointer(&region))); err != nil {
		return fail("KVM_SET_USER_MEMORY_REGION", err)
	}
	_, _ = ioctl(vm, kvmSetTSSAddr, 0xfffbd000) // needed by VT-x without unrestricted guest; harmless elsewhere
	vcpu, err := ioctl(vm, kvmCreateVCPU, 0)
	if err != nil {
		return fail("KVM_CREATE_VCPU", err)
	}
	defer unix.Close(int(vcpu))
	size, err := ioctl(kvm, kvmGetVCPUMmapSize, 0)
	if err != nil {
		return fail("KVM_GET_VCPU_MMAP_SIZE", err)
	}
	run, err := unix.Mmap(int(vcpu), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("kvm_run mmap", err)
	}
	defer func() { _ = unix.Munmap(run) }()
	runPtr.Store(&run[1]) // struct kvm_run: request_interrupt_window u8, immediate_exit u8, ...
	var sregs kvmSregs
	if _, err := ioctl(int(vcpu), kvmGetSregs, uintptr(unsafe.Pointer(&sregs))); err != nil {
		return fail("KVM_GET_SREGS", err)
	}
	sregs.CS.Base, sregs.CS.Selector = 0, 0
	if _, err := ioctl(int(vcpu), kvmSetSregs, uintptr(unsafe.Pointer(&sregs))); err != nil {
		return fail("KVM_SET_SREGS", err)
	}
	regs := kvmRegs{RIP: codeAddr, RFLAGS: 2}
	if _, err := ioctl(int(vcpu), kvmSetRegs, uintptr(unsafe.Pointer(&regs))); err != nil {
		return fail("KVM_SET_REGS", err)
	}
	var cpu0, cpu1 unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &cpu0)
	wall0 := time.Now()
	for {
		if stop.Load() {
			return probeResult{err: "stopped before HLT"}
		}
		_, err := ioctl(int(vcpu), kvmRun, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fail("KVM_RUN", err)
		}
		reason := *(*uint32)(unsafe.Pointer(&run[8]))
		if reason == kvmExitIntr {
			continue
		}
		if reason != kvmExitHLT {
			return probeResult{err: fmt.Sprintf("KVM_RUN exited with reason %d, not HLT", reason)}
		}
		break
	}
	wall := time.Since(wall0)
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &cpu1)
	if _, err := ioctl(int(vcpu), kvmGetRegs, uintptr(unsafe.Pointer(&regs))); err != nil {
		return fail("KVM_GET_REGS", err)
	}
	if regs.RCX&0xffffffff != 0 {
		return probeResult{err: fmt.Sprintf("guest halted with ecx=%d, not 0: the loop did not run", regs.RCX&0xffffffff)}
	}
	return probeResult{
		instructions: 1 + 2*probeLoops + 1,
		cpu:          time.Duration(cpu1.Nano() - cpu0.Nano()),
		wall:         wall,
	}
}
