package container

import (
	"encoding/binary"
	"fmt"
	"runtime"

	seccompbpf "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// The sandbox's seccomp filter is Docker's default profile compiled once per
// node start into a classic BPF program (compileSeccomp) and installed by
// opendsec-init (PID 1) before anything else runs, with no_new_privs and
// SECCOMP_FILTER_FLAG_TSYNC; the agent server and every process it starts
// inherit it.
// runc 1.1 would compile the same profile with libseccomp on every create,
// which costs ~16 ms of each create. docs/security.md explains why the
// protection is the same.

// seccompInSandbox is where the compiled filter is bind-mounted read-only.
const (
	seccompInSandbox = "/.opendsec/seccomp.bpf"
	seccompFile      = "seccomp.bpf"
)

// seccompArch returns the native architecture's syscall table. Syscalls of
// other ABIs (i386 via int 0x80, x32) never reach the profile's rules: the
// program fails them with EPERM (other audit arch) or ENOSYS (x32 numbers),
// where Docker would allow the 32-bit flavour of the same allow-list.
func seccompArch() (*arch.Info, error) {
	switch runtime.GOARCH {
	case "amd64":
		return arch.X86_64, nil
	case "arm64":
		return arch.AARCH64, nil
	}
	return nil, fmt.Errorf("seccomp filter: architecture %s not supported", runtime.GOARCH)
}

// compileSeccomp compiles an OCI seccomp profile into a seccomp BPF program
// for the native architecture, in the kernel's struct sock_filter layout
// (native endian, 8 bytes per instruction). Rules are tried in the
// profile's order and the first match decides, which is libseccomp's
// meaning too as long as no syscall appears under two different actions
// (checked). Names the architecture does not have are skipped, as
// libseccomp does.
func compileSeccomp(p *specs.LinuxSeccomp) ([]byte, error) {
	if p == nil {
		return nil, fmt.Errorf("seccomp filter: no profile")
	}
	info, err := seccompArch()
	if err != nil {
		return nil, err
	}
	def, err := seccompAction(p.DefaultAction, p.DefaultErrnoRet)
	if err != nil {
		return nil, fmt.Errorf("seccomp filter: default action: %w", err)
	}
	if def == seccompbpf.ActionAllow {
		return nil, fmt.Errorf("seccomp filter: default action must deny, got %s", p.DefaultAction)
	}
	policy := seccompbpf.Policy{DefaultAction: def}
	actionOf := map[string]seccompbpf.Action{}
	for i, sc := range p.Syscalls {
		act, err := seccompAction(sc.Action, sc.ErrnoRet)
		if err != nil {
			return nil, fmt.Errorf("seccomp filter: rule %d: %w", i, err)
		}
		conds := make(seccompbpf.ArgumentConditions, 0, len(sc.Args))
		for _, a := range sc.Args {
			c, err := seccompCondition(a)
			if err != nil {
				return nil, fmt.Errorf("seccomp filter: rule %d (%v): %w", i, sc.Names, err)
			}
			conds = append(conds, c)
		}
		g := seccompbpf.SyscallGroup{Action: act}
		for _, name := range sc.Names {
			if _, ok := info.SyscallNames[name]; !ok {
				continue
			}
			if prev, ok := actionOf[name]; ok && prev != act {
				return nil, fmt.Errorf("seccomp filter: %s has two actions (%s, %s): rule order would matter", name, prev, act)
			}
			actionOf[name] = act
			if len(conds) == 0 {
				g.Names = append(g.Names, name)
			} else {
				g.NamesWithCondtions = append(g.NamesWithCondtions, seccompbpf.NameWithConditions{Name: name, Conditions: conds})
			}
		}
		policy.Syscalls = append(policy.Syscalls, g)
	}
	insts, err := policy.Assemble()
	if err != nil {
		return nil, fmt.Errorf("seccomp filter: assemble: %w", err)
	}
	raw, err := bpf.Assemble(insts)
	if err != nil {
		return nil, fmt.Errorf("seccomp filter: assemble bpf: %w", err)
	}
	if len(raw) == 0 || len(raw) > 4096 {
		return nil, fmt.Errorf("seccomp filter: %d instructions (the kernel takes 1 to 4096)", len(raw))
	}
	out := make([]byte, 0, 8*len(raw))
	for _, r := range raw {
		out = binary.NativeEndian.AppendUint16(out, r.Op)
		out = append(out, r.Jt, r.Jf)
		out = binary.NativeEndian.AppendUint32(out, r.K)
	}
	return out, nil
}

func seccompAction(a specs.LinuxSeccompAction, errnoRet *uint) (seccompbpf.Action, error) {
	switch a {
	case specs.ActAllow:
		return seccompbpf.ActionAllow, nil
	case specs.ActErrno:
		errno := uint(unix.EPERM)
		if errnoRet != nil {
			errno = *errnoRet
		}
		if errno == 0 || errno > 4095 {
			return 0, fmt.Errorf("errno %d out of range 1-4095", errno)
		}
		if errno == uint(unix.EPERM) {
			// The library's spelling of EPERM (the only errno it accepts
			// as a default action).
			return seccompbpf.ActionErrno, nil
		}
		return seccompbpf.ActionErrno | seccompbpf.Action(errno), nil
	case specs.ActKill, specs.ActKillThread:
		return seccompbpf.ActionKillThread, nil
	case specs.ActKillProcess:
		return seccompbpf.ActionKillProcess, nil
	}
	return 0, fmt.Errorf("action %s not supported", a)
}

func seccompCondition(a specs.LinuxSeccompArg) (seccompbpf.Condition, error) {
	c := seccompbpf.Condition{Argument: uint32(a.Index), Value: a.Value}
	if a.Index > 5 {
		return c, fmt.Errorf("argument index %d out of range 0-5", a.Index)
	}
	switch a.Op {
	case specs.OpEqualTo:
		c.Operation = seccompbpf.Equal
	case specs.OpNotEqual:
		c.Operation = seccompbpf.NotEqual
	case specs.OpGreaterThan:
		c.Operation = seccompbpf.GreaterThan
	case specs.OpGreaterEqual:
		c.Operation = seccompbpf.GreaterOrEqual
	case specs.OpLessThan:
		c.Operation = seccompbpf.LessThan
	case specs.OpLessEqual:
		c.Operation = seccompbpf.LessOrEqual
	case specs.OpMaskedEqual:
		// Docker uses (arg & mask) == 0 only: no bit of mask set.
		if a.ValueTwo != 0 {
			return c, fmt.Errorf("SCMP_CMP_MASKED_EQ with a non-zero value %#x not supported", a.ValueTwo)
		}
		c.Operation = seccompbpf.BitsNotSet
	default:
		return c, fmt.Errorf("operator %s not supported", a.Op)
	}
	return c, nil
}
