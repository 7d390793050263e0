package container

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/interpreter"
)

// Files every sandbox bind-mounts read-only with the same content (the
// compiled seccomp filter, the code interpreter's runner, and resolv.conf
// for a set of nameservers) are written once per node, not into every
// bundle: a new file per create costs an inode allocation on the data
// dir's file system (on ext4 without a journal, a scan past every inode
// deleted in the last seconds), about half a millisecond of the node's CPU
// each in a burst.
//
// A shared file is named by a hash of its content and never changes once
// published (a new content is a new file), so a sandbox can neither change
// what another one reads nor see a later version of a file it mounted.
// Inside the sandbox it is a bind mount with ro, nosuid, nodev and noexec:
// writes, chmod, chown, utimes and xattrs through it fail with EROFS even
// for the sandbox's root, and without CAP_SYS_ADMIN (never given) the
// sandbox cannot remount it read-write or unmount it. A read-only mount
// updates no atime either, so sandboxes learn nothing from each other's
// reads. On the host the directory is root's, 0700.
type sharedFiles struct {
	dir string

	mu    sync.Mutex
	paths map[string]string // name + content hash -> path; guarded by mu
}

// sharedDir is where the node keeps its shared sandbox files.
func (c Config) sharedDir() string {
	if c.NodeStateDir != "" {
		return filepath.Join(c.NodeStateDir, "container", "shared")
	}
	return c.StateRoot + ".shared"
}

// file returns the path of a read-only file of mode holding b, named
// after name (e.g. seccomp.bpf becomes seccomp-<hash>.bpf). It is written
// the first time this node asks for it; a file of that name left by an
// earlier run is used if it holds exactly b and has mode, else replaced
// (atomically: a sandbox that mounted the old one keeps it).
func (s *sharedFiles) file(name string, b []byte, mode os.FileMode) (string, error) {
	sum := sha256.Sum256(b)
	ext := filepath.Ext(name)
	p := filepath.Join(s.dir, strings.TrimSuffix(name, ext)+"-"+hex.EncodeToString(sum[:12])+ext)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.paths == nil {
		s.paths = map[string]string{}
	}
	if got, ok := s.paths[p]; ok {
		return got, nil
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return "", fmt.Errorf("create shared sandbox file dir: %w", err)
	}
	if err := os.Chmod(s.dir, 0o700); err != nil {
		return "", fmt.Errorf("chmod shared sandbox file dir: %w", err)
	}
	if !sameFile(p, b, mode) {
		tmp := p + ".tmp"
		os.Remove(tmp)
		if err := os.WriteFile(tmp, b, mode); err != nil {
			return "", fmt.Errorf("write shared sandbox file %s: %w", name, err)
		}
		// WriteFile's mode passes through the umask.
		if err := os.Chmod(tmp, mode); err != nil {
			os.Remove(tmp)
			return "", fmt.Errorf("chmod shared sandbox file %s: %w", name, err)
		}
		if err := os.Rename(tmp, p); err != nil {
			os.Remove(tmp)
			return "", fmt.Errorf("publish shared sandbox file %s: %w", name, err)
		}
	}
	s.paths[p] = p
	return p, nil
}

// sameFile reports whether p is a regular file of root's holding exactly
// b with permissions mode.
func sameFile(p string, b []byte, mode os.FileMode) bool {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return false
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || os.FileMode(st.Mode&0o7777) != mode || st.Uid != 0 || st.Size != int64(len(b)) {
		return false
	}
	got, err := os.ReadFile(p)
	return err == nil && bytes.Equal(got, b)
}

// resolvConf is the content of a resolv.conf naming nameservers.
func resolvConf(nameservers []string) []byte {
	var rc strings.Builder
	for _, ns := range nameservers {
		fmt.Fprintf(&rc, "nameserver %s\n", ns)
	}
	return []byte(rc.String())
}

// useSharedFiles points sp's bind mounts of the seccomp filter, the code
// interpreter and resolv.conf (bundle files in ociSpec) at the node's
// shared copies.
func (r *Runtime) useSharedFiles(sp *specs.Spec, nameservers []string) error {
	seccomp, err := r.shared.file(seccompFile, r.seccomp, 0o400)
	if err != nil {
		return err
	}
	interp, err := r.shared.file(interpreterFile, interpreter.Source, 0o444)
	if err != nil {
		return err
	}
	src := map[string]string{seccompInSandbox: seccomp, interpreter.PathInSandbox: interp}
	if len(nameservers) > 0 {
		if src["/etc/resolv.conf"], err = r.shared.file(resolvFile, resolvConf(nameservers), 0o644); err != nil {
			return err
		}
	}
	for i := range sp.Mounts {
		if p, ok := src[sp.Mounts[i].Destination]; ok && sp.Mounts[i].Type == "bind" {
			sp.Mounts[i].Source = p
			delete(src, sp.Mounts[i].Destination)
		}
	}
	if len(src) > 0 {
		return fmt.Errorf("config.json: no bind mount for %d shared files", len(src))
	}
	return nil
}
