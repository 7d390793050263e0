package container

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// crun without Debian's libsystemd.
//
// Debian's crun 1.8 links libsystemd.so.0 (for the systemd cgroup manager
// and sd-bus, journald logging and the notify socket, none of which the
// node uses), and through it libgcrypt, liblzma, libzstd, liblz4 and
// libgpg-error: ten libraries for ld.so to map and relocate (crun is
// linked BIND_NOW) on every crun command, and to tear down at its exit.
// Where opendsec-crun-libsystemd.so (crunlib/libsystemd.c, every function
// crun takes from libsystemd, none doing anything) is installed next to
// the agent, crun runs with it preloaded: ld.so takes it for
// libsystemd.so.0 (its soname) and loads five libraries. A crun run of a
// container cost ~0.6 ms of CPU less (bench/results/2026-12-06-cpuset-view.md).
// It is preloaded only when every symbol crun imports from libsystemd is
// in it with the same version (crunPreload), and crun's probe is run with
// it first (probeCrun): a crun that needs more of libsystemd runs with the
// real one.

// CrunLibsystemdName is the file name of the libsystemd.so.0 without
// systemd, looked for next to the agent (scripts/build-init.sh builds it
// beside opendsec-init).
const CrunLibsystemdName = "opendsec-crun-libsystemd.so"

// crunPreload returns lib when crun at crunPath should run with it
// preloaded: lib is a regular file only root can change, crun imports
// libsystemd.so.0, and lib defines every symbol crun imports from it at
// the version crun asks for. "" and nil when there is no lib or crun does
// not link libsystemd; "" and why not otherwise.
func crunPreload(crunPath, lib string) (string, error) {
	if _, err := os.Lstat(lib); errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	// The checks below are of the file and directories ld.so will open.
	real, err := filepath.EvalSymlinks(lib)
	if err != nil {
		return "", err
	}
	fi, err := os.Lstat(real)
	if err != nil {
		return "", err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !fi.Mode().IsRegular() || !ok || st.Uid != 0 || fi.Mode().Perm()&0o022 != 0 {
		return "", fmt.Errorf("%s is not a regular file owned by root and writable by root only", lib)
	}
	for d := filepath.Dir(real); ; d = filepath.Dir(d) {
		var dst unix.Stat_t
		if err := unix.Stat(d, &dst); err != nil {
			return "", err
		}
		if dst.Uid != 0 || dst.Mode&0o022 != 0 && dst.Mode&unix.S_ISVTX == 0 {
			return "", fmt.Errorf("%s is in %s, which users other than root can change", lib, d)
		}
		if d == "/" || d == "." {
			break
		}
	}
	needs, err := libsystemdImports(crunPath)
	if err != nil || len(needs) == 0 {
		return "", err
	}
	has, err := definedSymbols(real)
	if err != nil {
		return "", err
	}
	for _, s := range needs {
		if !has[s] {
			return "", fmt.Errorf("crun imports %s from libsystemd, which %s does not define", s, lib)
		}
	}
	return real, nil
}

// libsystemdImports returns crun's imports from libsystemd.so.0, each
// "name@version" ("name@" unversioned); none when crun does not link it.
func libsystemdImports(crunPath string) ([]string, error) {
	f, err := elf.Open(crunPath)
	if err != nil {
		return nil, fmt.Errorf("read crun's ELF: %w", err)
	}
	defer f.Close()
	libs, err := f.ImportedLibraries()
	if err != nil {
		return nil, fmt.Errorf("read crun's libraries: %w", err)
	}
	linked := false
	for _, l := range libs {
		linked = linked || l == "libsystemd.so.0"
	}
	if !linked {
		return nil, nil
	}
	syms, err := f.ImportedSymbols()
	if err != nil {
		return nil, fmt.Errorf("read crun's imports: %w", err)
	}
	var out []string
	for _, s := range syms {
		if s.Library == "libsystemd.so.0" {
			out = append(out, s.Name+"@"+s.Version)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("crun links libsystemd.so.0 but names no symbol of it (no version information)")
	}
	return out, nil
}

// definedSymbols returns the functions and objects lib defines, as
// "name@version" (its symbol versions), and "name@" for those without.
func definedSymbols(lib string) (map[string]bool, error) {
	f, err := elf.Open(lib)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", lib, err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		return nil, fmt.Errorf("read %s's symbols: %w", lib, err)
	}
	out := map[string]bool{}
	for _, s := range syms {
		if s.Section == elf.SHN_UNDEF || s.Section == elf.SHN_ABS {
			continue
		}
		out[s.Name+"@"+s.Version] = true
	}
	return out, nil
}

// crunEnv is the OCI runtime's whole environment (runc's too, without a
// preload): a standard PATH (the runtime finds the container's program
// with config.json's), and the preloaded lib. Not the node's: a
// NOTIFY_SOCKET or LISTEN_FDS of the node's would make the runtime hand
// the container the node's systemd notify socket or listening fds.
func crunEnv(preload string) []string {
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	if preload != "" {
		env = append(env, "LD_PRELOAD="+preload)
	}
	return env
}
